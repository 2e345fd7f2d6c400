"""Conditional writes of the objects under one folder of a location: a write creates an object
or replaces the one last read, or raises ``Conflict`` (it changed since) or ``Uncertain`` (its
outcome is unknown); the caller reads again either way.

* local: a transition holds an exclusive ``flock`` on the folder's lock file (``exclusive``)
  and each write replaces the file atomically (``spill.store.fs.put_bytes``). Only file systems known to honour
  flock are accepted; a network or unknown file system is refused in one line. A fixed name
  that holds what spill did not put there (a folder or a link where a file belongs) is refused
  in one line that names what to remove (in the words of the folder's ``Layout``).
* ``memory://`` (tests): one store per process, so a lock in this process is enough.
* object stores (``spill.store.objstore``): create with ``If-None-Match: *`` (GCS:
  ``ifGenerationMatch=0``), replace with ``If-Match: <etag>`` (GCS: the generation read), never
  delete. ``store_for`` probes a store once per bucket and process and refuses one that
  accepts a second create, a wrong or a stale replace.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from spill.errors import EXIT_PREEMPTED, SpillError, StoreError
from spill.ground.validate import remember, validate
from spill.store.fs import get_bytes, is_temp, join, mount_type, put_bytes
from spill.store.location import Location, location

LOCK_WAIT = 10.0  # seconds a transition waits for the local lock before saying so
ATTEMPTS = 50  # conditional writes lost to others (or uncertain) before a transition gives up
FLOCK_FS = frozenset(
    "ext2 ext3 ext4 xfs btrfs tmpfs ramfs zfs overlay apfs hfs f2fs bcachefs jfs".split()
)


@dataclass(frozen=True)
class Layout:
    """The folder a store keeps under its location, and what its refusals call the things in it."""

    folder: str  # under the location
    lock: str  # the local lock file, in the folder
    folder_is: str  # the folder itself, in words
    subfolder_is: str  # a folder in it
    object_is: str  # an object in it, unless ``named`` has a word for its key
    named: Mapping[str, str] = field(default_factory=dict)
    then: Mapping[str, str] = field(default_factory=dict)  # by name: what removing it leads to


class LockHeld(SpillError):
    """The local lock stays held (its holder was stopped mid-transition): try again later."""

    exit_code = EXIT_PREEMPTED


class Unsupported(StoreError):
    """A location whose transitions cannot be made safe (file system or object store)."""


class Conflict(Exception):
    """A conditional write lost: the object changed since it was read (412)."""


class Uncertain(Exception):
    """A conditional write whose outcome is unknown (timeout, dropped connection, 5xx)."""


class Store:
    """Read and conditionally write the objects under ``layout.folder`` of the location ``state``."""

    # whether ``exclusive`` keeps whole transitions apart (a lock): then no reader ever sees
    # what another transition made between two of its writes (an object store: False)
    serialized = False

    def put(self, key: str, doc: dict[str, Any], schema: str, tag: str | None) -> str:
        """Validate ``doc`` against ``schema`` and ``write`` it; returns the new object's tag.
        Its bytes are remembered as valid, so that the next read (``spill status``, a finished
        build) costs one hash."""
        raw = json.dumps(doc, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"
        validate(doc, schema, where=self.uri(key))
        new = self.write(key, raw, tag)
        remember(raw, schema)
        return new or self.tag_of(raw)

    def tag_of(self, data: bytes) -> str:
        """The tag ``read`` reports for an object holding ``data``."""
        return hashlib.sha256(data).hexdigest()

    def __init__(self, state: str, layout: Layout):
        self.state: Location = location(state)
        self.layout = layout

    def uri(self, key: str) -> str:
        return join(self.state, self.layout.folder, key)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        yield

    def read(self, key: str) -> tuple[bytes | None, str | None]:
        raise NotImplementedError

    def write(self, key: str, data: bytes, tag: str | None) -> str | None:
        """Create (``tag`` None) or replace the object last read with ``tag``; the new object's
        tag where the store reports it (GCS, Azure), else None (``tag_of`` tells it)."""
        raise NotImplementedError


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


class _LocalStore(Store):
    serialized = True

    def __init__(self, state: str, layout: Layout):
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
        import fcntl

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


class _MemoryStore(Store):
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


def open_store(state: str, layout: Layout) -> Store:
    """The store of ``layout`` at ``state``, unchecked: enough to read (reads take no lock); the
    kind is the location's (``Location.writes``)."""
    state = location(state)
    if state.writes == "flock":
        return _LocalStore(state, layout)
    if state.writes == "process":
        return _MemoryStore(state, layout)
    from spill.store.objstore import ObjectStore

    return ObjectStore(state, layout)


def store_for(state: str, layout: Layout) -> Store:
    """The store of ``layout`` at ``state``, checked (a local one honours flock, an object store
    refuses stale writes)."""
    s = open_store(state, layout)
    if isinstance(s, _LocalStore):
        s.check()
    elif not isinstance(s, _MemoryStore):
        from spill.store.objstore import probe

        probe(s)
    return s
