"""Conditional writes of a state location's control keys (``runs/...``), and reading them.

* local: every transition holds an exclusive ``flock`` on ``runs/control.lock`` and replaces the
  file atomically (write, fsync, rename, fsync the folder). Only file systems known to honour
  flock are accepted; a network or unknown file system is refused in one line. A fixed name
  under ``runs/`` that is not what spill keeps there (a folder or a link where the lock file,
  ``current.json`` or a ``control.json`` belongs) is refused in one line that names what to
  remove.
* ``memory://`` (tests): one store per process, so a lock in this process is enough.
* object stores (``spill.control.objstore``): create with ``If-None-Match: *``, replace with
  ``If-Match: <etag>``, never delete; a lost write is a ``_Conflict``, one whose outcome is
  unknown ``_Uncertain``, and the caller reads again either way. ``store_for`` probes a store
  once per bucket and process and refuses one that accepts a second create or a stale replace.

``current`` is the readers' view of the current run (``spill.control.runlist``: when
``runs/current.json`` is missing, the view rebuilt from the control objects).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from typing import Any

from spill.errors import EXIT_PREEMPTED, SpillError, StoreError
from spill.store.fs import (
    _local,
    get_bytes,
    is_local,
    is_temp,
    join,
    listdir,
    mount_type,
    put_bytes,
)
from spill.validate import parse_json, remember, validate, validate_once

RUNS = "runs"
CURRENT = "current.json"
CONTROL = "control.json"
LOCK = "control.lock"
RUN_ID = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")  # as schemas/runs.schema.json says
LOCK_WAIT = 10.0  # seconds a transition waits for the local lock before saying so
ATTEMPTS = 50  # conditional writes lost to others (or uncertain) before a transition gives up
FLOCK_FS = frozenset(
    "ext2 ext3 ext4 xfs btrfs tmpfs ramfs zfs overlay apfs hfs f2fs bcachefs jfs".split()
)


class LockHeld(SpillError):
    """The local lock stays held (its holder was stopped mid-transition): try again later."""

    exit_code = EXIT_PREEMPTED


class Unsupported(StoreError):
    """A location whose transitions cannot be made safe (file system or object store)."""


class _Conflict(Exception):
    """A conditional write lost: the object changed since it was read (412)."""


class _Uncertain(Exception):
    """A conditional write whose outcome is unknown (timeout, dropped connection, 5xx)."""


class Store:
    """Read and conditionally write the control keys of one state location."""

    def put(self, key: str, doc: dict[str, Any], schema: str, tag: str | None) -> str:
        """Validate ``doc`` against ``schema`` and ``write`` it; returns the new object's tag.
        Its bytes are remembered as valid, so that the next read (``spill status``, a finished
        build) costs one hash."""
        raw = json.dumps(doc, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"
        validate(doc, schema, where=self.uri(key))
        self.write(key, raw, tag)
        remember(raw, schema)
        return self.tag_of(raw)

    def tag_of(self, data: bytes) -> str:
        """The tag ``read`` reports for an object holding ``data``."""
        return hashlib.sha256(data).hexdigest()

    def __init__(self, state: str):
        self.state = state

    def uri(self, key: str) -> str:
        return join(self.state, RUNS, key)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        yield

    def read(self, key: str) -> tuple[bytes | None, str | None]:
        raise NotImplementedError

    def write(self, key: str, data: bytes, tag: str | None) -> None:
        """Create (``tag`` None) or replace the object last read with ``tag``."""
        raise NotImplementedError


_THEN = {  # what removing a fixed name that holds something else leads to
    LOCK: "; the next command makes it again",
    CURRENT: "; the next command rebuilds it from the runs' control objects",
    CONTROL: ", then put the run's control object back from a copy (else the run is lost)",
}


def _foreign(path: str, wants: str) -> StoreError:
    """One line for a fixed name under ``runs/`` that holds what spill did not put there."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        mode = 0
    kinds = {stat.S_ISDIR: "a folder", stat.S_ISLNK: "a link", stat.S_ISFIFO: "a named pipe"}
    kind = next((k for test, k in kinds.items() if test(mode)), "a special file")
    kind = "a file" if stat.S_ISREG(mode) else kind
    then = _THEN.get(os.path.basename(path), " if nothing of yours is in it")
    return StoreError(f"{path} is {kind}, not {wants}; remove it (rm -r {path}){then}")


class _LocalStore(Store):
    def __init__(self, state: str):
        super().__init__(state)
        self.dir = _local(join(state, RUNS))

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

        lock = os.path.join(self.dir, LOCK)
        try:
            os.makedirs(self.dir, exist_ok=True)
            # never through a link, never blocking on a named pipe: only the file spill made
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except (FileExistsError, NotADirectoryError):  # runs/ (or a folder above) is a file
            raise _foreign(self.dir, "the folder of the runs") from None
        except OSError as e:
            if os.path.islink(lock) or os.path.lexists(lock) and not os.path.isfile(lock):
                raise _foreign(lock, "the lock file spill keeps") from None
            raise StoreError(f"{lock}: cannot open ({e.strerror}); check its permissions") from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a device or a fifo opens, but is no file
                raise _foreign(lock, "the lock file spill keeps")
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
        wants = "the run list" if key == CURRENT else "a control object"
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None, None
        except NotADirectoryError:  # runs/<id> (or runs/) is a file
            up = os.path.dirname(path)
            raise _foreign(
                up, "the folder of the runs" if up == self.dir else "a run's folder"
            ) from None
        except OSError as e:
            raise StoreError(f"{path}: cannot read ({e.strerror}); check its permissions") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise _foreign(path, wants)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        return data, hashlib.sha256(data).hexdigest()

    def write(self, key: str, data: bytes, tag: str | None) -> None:
        if self.read(key)[1] != tag:  # under the lock: changed since our last write of it
            raise _Conflict()
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
            raise _Conflict()
        put_bytes(self.uri(key), data)


def _store(state: str) -> Store:
    if is_local(state):
        return _LocalStore(state)
    if state.startswith("memory://"):
        return _MemoryStore(state)
    from spill.control.objstore import ObjectStore

    return ObjectStore(state)


def store_for(state: str) -> Store:
    """The store of ``state``, checked (a local one honours flock, an object store 412s)."""
    s = _store(state)
    if isinstance(s, _LocalStore):
        s.check()
    elif not isinstance(s, _MemoryStore):
        from spill.control.objstore import probe

        probe(s)
    return s


def parse(raw: bytes, schema: str, where: str) -> dict[str, Any]:
    try:
        doc = parse_json(raw)
    except ValueError as e:
        raise StoreError(f"{where} is not JSON ({e}); it was damaged") from None
    validate_once(raw, doc, schema, where)
    return doc


def run_list(runs: list[str]) -> dict[str, Any]:
    """A ``runs/current.json`` document: the last of ``runs`` is current."""
    return {"schema_version": 1, "kind": "spill-runs", "current": runs[-1], "runs": runs}


def read_runs(store: Store) -> tuple[dict[str, Any] | None, str | None]:
    raw, tag = store.read(CURRENT)
    return (None, None) if raw is None else (parse(raw, "runs", store.uri(CURRENT)), tag)


def read_control(store: Store, run: str) -> tuple[dict[str, Any] | None, str | None]:
    key = f"{run}/{CONTROL}"
    raw, tag = store.read(key)
    return (None, None) if raw is None else (parse(raw, "control", store.uri(key)), tag)


def run_ids(store: Store) -> list[str]:
    """The ids of the runs under ``runs/`` (folders named like a run), sorted."""
    return [n for n in listdir(join(store.state, RUNS)) if RUN_ID.fullmatch(n)]


def current(state: str) -> dict[str, Any] | None:
    """The current run's control object at ``state`` (validated), or None when it has none.

    A reader's view: no lock is taken (every write is an atomic replace) and nothing is written
    (``spill.control.runlist.current``)."""
    from spill.control.runlist import current as view

    return view(state)
