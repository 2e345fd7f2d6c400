"""Conditional writes on a local disk and in ``memory://``.

* local: a transition holds an exclusive ``flock`` on the folder's lock file (``exclusive``)
  and each write replaces the file atomically (``spill.store.fs.put_bytes``). Only file systems
  known to honour flock are accepted (``FLOCK_FS``); a network or unknown one is refused in one
  line. A fixed name that holds what spill did not put there (a folder or a link where a file
  belongs) is refused in one line that names what to remove (in the words of the ``Layout``).
* ``memory://`` (tests): one store per process, so a lock in this process is enough.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from spill.errors import StoreError
from spill.store.cas.store import Conflict, Layout, LockHeld, Store, Unsupported
from spill.store.fs import get_bytes, is_temp, put_bytes
from spill.store.location import Location

LOCK_WAIT = 10.0  # seconds a transition waits for the local lock before saying so
FLOCK_FS = frozenset(
    "ext2 ext3 ext4 xfs btrfs tmpfs ramfs zfs overlay apfs hfs f2fs bcachefs jfs".split()
)


def mount_type(path: str) -> str:
    """The file system type of the mount holding ``path`` (``""`` when it cannot be told)."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                point = left.split()[4].encode().decode("unicode_escape")
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, right.split()[0]
        return kind
    except (OSError, IndexError):
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["mount"], capture_output=True, text=True).stdout
        except OSError:
            return ""
        for line in out.splitlines():
            m = re.match(r".+ on (.+) \(([a-z0-9]+)", line)
            inside = m and (real == m[1] or real.startswith(m[1].rstrip("/") + "/"))
            if inside and len(m[1]) >= len(best):
                best, kind = m[1], m[2]
    return kind


def _foreign(path: str, wants: str, layout: Layout) -> StoreError:
    """One line for a fixed name in a store's folder that holds what spill did not put there."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = 0
    kinds = {stat.S_ISDIR: "a folder", stat.S_ISLNK: "a link", stat.S_ISFIFO: "a named pipe"}
    kind = next((k for test, k in kinds.items() if test(mode)), "a special file")
    kind = "a file" if stat.S_ISREG(mode) else kind
    then = layout.then.get(os.path.basename(path), " if nothing of yours is in it")
    return StoreError(f"{path} is {kind}, not {wants}; remove it (rm -r {path}){then}")


class LocalStore(Store):
    serialized = True

    def __init__(self, state: Location | str, layout: Layout):
        super().__init__(state, layout)
        self.dir = self.state.join(layout.folder).path

    def check(self) -> None:
        probe = self.dir
        while not os.path.exists(probe):
            probe = os.path.dirname(probe) or "."
        kind = mount_type(probe)
        if kind not in FLOCK_FS:
            what = f"a {kind} file system" if kind else "a file system spill cannot identify"
            raise Unsupported(
                f"{self.state} is on {what}, where locks are not reliable; keep the state on a "
                "local disk, or give --state an object store URI (s3://...)"
            )

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        lock, layout = os.path.join(self.dir, self.layout.lock), self.layout
        try:
            os.makedirs(self.dir, exist_ok=True)
            # never through a link, never blocking on a named pipe: only the file spill made
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except (FileExistsError, NotADirectoryError):  # runs/ (or a folder above) is a file
            raise _foreign(self.dir, layout.folder_is, layout) from None
        except OSError as e:
            if os.path.islink(lock) or os.path.lexists(lock) and not os.path.isfile(lock):
                raise _foreign(lock, "the lock file spill keeps", layout) from None
            raise StoreError(f"{lock}: cannot open ({e.strerror}); check its permissions") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a device or a fifo opens, but is no file
                raise _foreign(lock, "the lock file spill keeps", layout)
            # A transition holds the lock for milliseconds; one held for LOCK_WAIT belongs to a
            # process that was stopped (SIGSTOP, Ctrl-Z, a paused VM) in the middle of one.
            give_up, pause = time.monotonic() + LOCK_WAIT, 0.002
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > give_up:
                        raise LockHeld(
                            f"{lock} has been locked for {LOCK_WAIT:g} s by a process that does "
                            "not let go (stopped?); try again later"
                        ) from None
                    time.sleep(pause)
                    pause = min(pause * 2, 0.05)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def read(self, key: str) -> tuple[bytes | None, str | None]:
        path = os.path.join(self.dir, key)
        layout = self.layout
        wants = layout.named.get(key, layout.object_is)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None, None
        except NotADirectoryError:  # runs/<id> (or runs/) is a file
            up = os.path.dirname(path)
            what = layout.folder_is if up == self.dir else layout.subfolder_is
            raise _foreign(up, what, layout) from None
        except OSError as e:
            raise StoreError(f"{path}: cannot read ({e.strerror}); check its permissions") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _foreign(path, wants, layout)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        return data, hashlib.sha256(data).hexdigest()

    def write(self, key: str, data: bytes, tag: str | None) -> None:
        if self.read(key)[1] != tag:  # under the lock: changed since our last write of it
            raise Conflict()
        # Every write of this key holds the lock, so a temporary file of it found now is one a
        # killed writer left: remove it, or it outlives every later write of the object.
        folder, name = os.path.split(os.path.join(self.dir, key))
        for n in os.listdir(folder) if os.path.isdir(folder) else ():
            if n.startswith(f".{name}") and is_temp(n):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, n))
        put_bytes(self.uri(key), data, drilled=False)


_MEMORY_LOCK = threading.RLock()


class MemoryStore(Store):
    """``memory://`` is one store per process: a lock in this process makes it conditional."""

    serialized = True

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with _MEMORY_LOCK:
            yield

    def read(self, key: str) -> tuple[bytes | None, str | None]:
        try:
            data = get_bytes(self.uri(key))
        except FileNotFoundError:
            return None, None
        return data, hashlib.sha256(data).hexdigest()

    def write(self, key: str, data: bytes, tag: str | None) -> None:
        if self.read(key)[1] != tag:
            raise Conflict()
        put_bytes(self.uri(key), data)
