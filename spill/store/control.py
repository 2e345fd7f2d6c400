"""One writer per run: control objects, leases and fencing.

A state location (a build's ``.spill/``, a job's ``--state``) holds its runs under ``runs/``::

    runs/current.json        which run is current, and the runs before it (schema ``runs``)
    runs/control.lock        local locations only: the flock every transition holds
    runs/<id>/control.json   the run's authority (schema ``control``)

A control object names the owner (host, boot id, pid and its start time, a random nonce), the
generation, the lease, the status (``active``, ``quiescing``, ``transferred``, ``incoming``,
``complete``), the current payloads and the lineage. It changes only by *transitions*: read the
newest document, check that the change is allowed (owner, generation, status), write the next
document conditionally:

* locally under an exclusive ``flock`` on ``runs/control.lock``, replaced atomically (write,
  fsync, rename, fsync the folder); only file systems known to honour flock are accepted;
* on an object store with ``If-None-Match: *`` (create) and ``If-Match: <etag>`` (replace),
  never a delete. A 412, or an outcome we cannot know (a timeout, a dropped connection), reads
  the object again: if our transition is in it (``last.op`` is ours) it happened; otherwise it
  is rebuilt from the newest document, which stops it when someone else owns the run now. A
  store that cannot refuse a stale write is refused by ``probe`` before anything is published.

``acquire`` makes this process the owner at the next generation when the run is free: no owner,
an owner that released it, a lease that expired, or (same host, same boot) an owner process that
is gone, so a SIGKILLed local job is taken over at once. Otherwise it raises ``Busy`` (exit 75,
the owner named) or, with ``wait``, polls until the run is free. The owner's heartbeat renews
the lease at a third of its length. Every publication (``Place.publish``) is a fenced
transition: a process whose generation is no longer the run's fails with ``Superseded`` and
what it wrote is never pointed at.

Payloads are folders written once, ``<job>/payloads/<kind>-g<generation>-s<seq>-<attempt>/``, so
two writers never write one name; a payload is current only while a pointer of the control object
names it. ``Place`` is a job's view of the run: its folder under the state location and the
pointers under its prefix.

Crash points for kill drills (``spill.store.drill``), each right after the transition's write:
``control-acquire``, ``control-renew``, ``control-publish``, ``control-complete``.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from spill.errors import EXIT_PREEMPTED, SpillError, StoreError
from spill.store import drill
from spill.store.fs import (
    _local,
    filesystem,
    get_bytes,
    is_local,
    join,
    listdir,
    put_bytes,
    remove,
)
from spill.store.schemas import SchemaInvalid, parse_json, validate, validate_once

RUNS = "runs"
CURRENT = "current.json"
CONTROL = "control.json"
LOCK = "control.lock"
PAYLOADS = "payloads"
LEASE = 120.0
LEASE_ENV = "SPILL_LEASE"
SCHEMA_VERSION = 1
ATTEMPTS = 50  # conditional writes lost to others (or uncertain) before a transition gives up
FLOCK_FS = frozenset(
    "ext2 ext3 ext4 xfs btrfs tmpfs ramfs zfs overlay apfs hfs f2fs bcachefs jfs".split()
)
_PAYLOAD = re.compile(r"([a-z]+)-g(\d+)-s(\d+)-(\d+)")

log = logging.getLogger(__name__)


class Busy(SpillError):
    """The run has a live owner; try again later (exit 75, like a preempted job)."""

    exit_code = EXIT_PREEMPTED


class Superseded(SpillError):
    """This process's generation is no longer the run's: another owner took it over."""


class Unsupported(StoreError):
    """A location whose transitions cannot be made safe (file system or object store)."""


class RunComplete(StoreError):
    """A completed run is read-only."""


class _Conflict(Exception):
    """A conditional write lost: the object changed since it was read (412)."""


class _Uncertain(Exception):
    """A conditional write whose outcome is unknown (timeout, dropped connection, 5xx)."""


# --- who this process is -------------------------------------------------------------------


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()[:64]
    except OSError:
        pass
    if sys.platform == "darwin":
        import subprocess

        try:
            out = subprocess.run(["sysctl", "-n", "kern.boottime"], capture_output=True, text=True)
            m = re.search(r"sec = (\d+)", out.stdout)
            return f"darwin-{m[1]}" if m else ""
        except OSError:
            return ""
    return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot (``""`` where unknown)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return ""
    fields = text[text.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else ""


def _pid_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        return text[text.rfind(")") + 2 :].split()[0]
    except (OSError, IndexError):
        return ""


def host() -> str:
    return socket.gethostname()


def me(nonce: str) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": host(),
        "boot": _boot_id(),
        "pid": pid,
        "start": _start_time(pid),
        "nonce": nonce,
        "since": time.time(),
        "released": False,
    }


def gone(owner: dict[str, Any]) -> bool:
    """Whether ``owner`` is provably dead: same host and boot, and its process is not there
    (or is a zombie, or the pid now belongs to a process that started at another time)."""
    if not owner["boot"] or owner["host"] != host() or owner["boot"] != _boot_id():
        return False
    pid = owner["pid"]
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    if _pid_state(pid) in ("Z", "X"):
        return True
    return bool(owner["start"]) and _start_time(pid) not in ("", owner["start"])


def lease_seconds(value: float | None = None) -> float:
    """The lease length: ``value``, else ``$SPILL_LEASE``, else 120 s."""
    if value is None:
        raw = os.environ.get(LEASE_ENV)
        try:
            value = float(raw) if raw else LEASE
        except ValueError:
            raise StoreError(f"{LEASE_ENV}={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise StoreError(f"a lease of {value} s cannot be renewed; give a positive number")
    return float(value)


def describe(doc: dict[str, Any], now: float | None = None) -> str:
    """``host pid 123 since 12:03:04, lease 97 s left`` for messages and ``spill status``."""
    now = time.time() if now is None else now
    o = doc["owner"]
    since = time.strftime("%H:%M:%S", time.localtime(o["since"]))
    left = doc["lease"]["expires"] - now
    lease = "released" if o["released"] else (f"lease {left:.0f} s left" if left > 0 else "lease expired")
    return f"{o['host']} pid {o['pid']} since {since}, {lease}"


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _dump(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"


def home_of(state: str) -> str:
    """Where a state location is, as recorded in its runs: ``host:/real/path`` or the URI."""
    if is_local(state):
        return f"{host()}:{os.path.realpath(_local(state))}"
    return state.rstrip("/")


# --- the stores: local (flock), memory (a lock in this process), object stores (conditional) ---


def _fs_type(path: str) -> str:
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
        import subprocess

        try:
            out = subprocess.run(["mount"], capture_output=True, text=True).stdout
        except OSError:
            return ""
        for line in out.splitlines():
            m = re.match(r".+ on (.+) \(([a-z0-9]+)", line)
            if m and (real == m[1] or real.startswith(m[1].rstrip("/") + "/")):
                if len(m[1]) >= len(best):
                    best, kind = m[1], m[2]
    return kind


class _Store:
    """Read and conditionally write the control keys of one state location."""

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


class _LocalStore(_Store):
    def __init__(self, state: str):
        super().__init__(state)
        self.dir = _local(join(state, RUNS))

    def check(self) -> None:
        probe = self.dir
        while not os.path.exists(probe):
            probe = os.path.dirname(probe) or "."
        kind = _fs_type(probe)
        if kind not in FLOCK_FS:
            what = f"a {kind} file system" if kind else "a file system spill cannot identify"
            raise Unsupported(
                f"{self.state} is on {what}, where locks are not reliable; keep the state on a "
                "local disk, or give --state an object store URI (s3://...)"
            )

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        import fcntl

        os.makedirs(self.dir, exist_ok=True)
        fd = os.open(os.path.join(self.dir, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    def read(self, key: str) -> tuple[bytes | None, str | None]:
        try:
            with open(os.path.join(self.dir, key), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None, None
        return data, hashlib.sha256(data).hexdigest()

    def write(self, key: str, data: bytes, tag: str | None) -> None:
        if self.read(key)[1] != tag:  # under the lock this cannot happen; a cheap assertion
            raise _Conflict()
        put_bytes(self.uri(key), data, drilled=False)


_MEMORY_LOCK = threading.RLock()


class _MemoryStore(_Store):
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


def _precondition_failed(e: BaseException) -> bool:
    text = f"{type(e).__name__} {e}"
    return "PreconditionFailed" in text or "412" in text or "ConditionalRequestConflict" in text


class _ObjectStore(_Store):
    """An fsspec object store (s3://, and gs://, az:// if ``probe`` accepts them)."""

    def __init__(self, state: str):
        super().__init__(state)
        self.fs, _ = filesystem(state)

    def _path(self, key: str) -> str:
        return filesystem(self.uri(key))[1]

    def read(self, key: str) -> tuple[bytes | None, str | None]:
        path = self._path(key)
        for _ in range(ATTEMPTS):  # the ETag before and after the body must agree
            try:
                self.fs.invalidate_cache(path)
                before = self.fs.info(path).get("ETag")
                data = self.fs.cat_file(path)
                self.fs.invalidate_cache(path)
                after = self.fs.info(path).get("ETag")
            except FileNotFoundError:
                return None, None
            except Exception as e:
                raise StoreError(
                    f"{self.uri(key)}: cannot read ({type(e).__name__}: {e}); check the location "
                    "and its credentials"
                ) from e
            if before and before == after:
                return data, before.strip('"')
        raise StoreError(f"{self.uri(key)} changes faster than it can be read; try again")

    def write(self, key: str, data: bytes, tag: str | None) -> None:
        path = self._path(key)
        try:
            if tag is None:
                self.fs.pipe_file(path, data, mode="create")
            else:
                self.fs.pipe_file(path, data, IfMatch=f'"{tag}"')
        except FileExistsError:
            raise _Conflict() from None
        except FileNotFoundError:
            raise _Conflict() from None  # If-Match on a key that is not there (never deleted)
        except Exception as e:
            if _precondition_failed(e) or (isinstance(e, OSError) and e.errno == errno.EINVAL):
                raise _Conflict() from None
            log.info("uncertain write of %s (%s: %s); reading it back", path, type(e).__name__, e)
            raise _Uncertain() from None
        finally:
            self.fs.invalidate_cache(path)


_probed: set[str] = set()


def _probe(store: _ObjectStore) -> None:
    """Refuse a store that does not refuse stale writes: under a scratch key, create twice and
    replace with a stale tag; both second writes must fail, the good replace must land."""
    where = store.state.split("://", 1)[0] + "://" + filesystem(store.state)[1].split("/")[0]
    if where in _probed:
        return
    key = f".probe-{secrets.token_hex(8)}"
    why = ""
    try:
        store.write(key, b"1", None)
        _, tag = store.read(key)
        try:
            store.write(key, b"2", None)
            why = "a second create of one key succeeded"
        except _Conflict:
            store.write(key, b"3", tag)
            try:
                store.write(key, b"4", tag)
                why = "a replace with a stale ETag succeeded"
            except _Conflict:
                pass
    except (_Conflict, _Uncertain) as e:
        why = f"a conditional write failed ({type(e).__name__.strip('_').lower()})"
    except (TypeError, ValueError, NotImplementedError) as e:
        why = f"its backend takes no preconditions ({type(e).__name__}: {e})"
    finally:
        with contextlib.suppress(Exception):
            store.fs.rm(store._path(key))  # a scratch key, not a control object
    if why:
        raise Unsupported(
            f"{store.state}: this object store cannot make conditional writes ({why}), so two "
            "writers could not be kept apart; use s3:// (or a local disk) for the state"
        )
    _probed.add(where)


def store_for(state: str) -> _Store:
    if is_local(state):
        s = _LocalStore(state)
        s.check()
        return s
    if state.startswith("memory://"):
        return _MemoryStore(state)
    s = _ObjectStore(state)
    _probe(s)
    return s


# --- reading ---------------------------------------------------------------------------------


def _parse(raw: bytes, schema: str, where: str) -> dict[str, Any]:
    try:
        doc = parse_json(raw)
    except ValueError as e:
        raise StoreError(f"{where} is not JSON ({e}); it was damaged") from None
    try:
        validate_once(raw, doc, schema, where)
    except SchemaInvalid:
        raise
    return doc


def _read_runs(store: _Store) -> tuple[dict[str, Any] | None, str | None]:
    raw, tag = store.read(CURRENT)
    return (None, None) if raw is None else (_parse(raw, "runs", store.uri(CURRENT)), tag)


def _read_control(store: _Store, run: str) -> tuple[dict[str, Any] | None, str | None]:
    key = f"{run}/{CONTROL}"
    raw, tag = store.read(key)
    return (None, None) if raw is None else (_parse(raw, "control", store.uri(key)), tag)


def current(state: str) -> dict[str, Any] | None:
    """The current run's control object at ``state`` (validated), or None when it has none.

    A reader's view: no lock is taken (every write is an atomic replace)."""
    if is_local(state):
        store: _Store = _LocalStore(state)  # reading needs no flock, so no file system check
    elif state.startswith("memory://"):
        store = _MemoryStore(state)
    else:
        store = _ObjectStore(state)
    runs, _ = _read_runs(store)
    if runs is None:
        return None
    doc, _ = _read_control(store, runs["current"])
    if doc is None:
        raise StoreError(
            f"{store.uri(CURRENT)} names run {runs['current']}, which has no control object; "
            "the state was copied incompletely"
        )
    return doc


# --- the owner's handle ----------------------------------------------------------------------


def _new_run_id() -> str:
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


class Run:
    """This process's ownership of a run: transitions, heartbeat, and its places."""

    def __init__(self, store: _Store, doc: dict[str, Any], lease: float):
        self.store, self.doc, self.lease = store, doc, lease
        self.id, self.gen, self.nonce = doc["run"], doc["generation"], doc["owner"]["nonce"]
        self._lock = threading.RLock()
        self._ops = 0
        self._beat: threading.Thread | None = None
        self._stop = threading.Event()
        self.lost: Superseded | None = None

    @property
    def state(self) -> str:
        return self.store.state

    def place(self, prefix: str = "") -> Place:
        return Place(self.state, prefix, self)

    # transitions

    def _transact(self, what: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]) -> dict:
        """Apply ``change`` to the newest document as a fenced, conditional transition."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            self._ops += 1
            op = f"{self.nonce}:{self._ops}"
            key = f"{self.id}/{CONTROL}"
            for _ in range(ATTEMPTS):
                with self.store.exclusive():
                    doc, tag = _read_control(self.store, self.id)
                    if doc is None:
                        raise StoreError(f"{self.store.uri(key)} disappeared; the state was damaged")
                    if doc["last"]["op"] == op:  # an uncertain write of ours that did land
                        self.doc = doc
                        return doc
                    self._fence(doc)
                    new = change(json.loads(json.dumps(doc)))
                    if new is None:
                        self.doc = doc
                        return doc
                    now = time.time()
                    new["seq"] = doc["seq"] + 1
                    new["last"] = {"op": op, "what": what, "at": now}
                    new["updated"] = _iso(now)
                    if not new["owner"]["released"] and new["status"] != "complete":
                        new["lease"]["expires"] = now + self.lease
                    raw = _dump(new)
                    validate(new, "control", where=self.store.uri(key))
                    try:
                        self.store.write(key, raw, tag)
                    except (_Conflict, _Uncertain):
                        continue
                self.doc = new
                return new
            raise StoreError(
                f"{self.store.uri(key)}: {what} lost {ATTEMPTS} conditional writes in a row; "
                "try again"
            )

    def _fence(self, doc: dict[str, Any]) -> None:
        o = doc["owner"]
        if doc["generation"] != self.gen or o["nonce"] != self.nonce:
            self.lost = Superseded(
                f"run {self.id} was taken over by {o['host']} pid {o['pid']} (generation "
                f"{doc['generation']}); this process (generation {self.gen}) stops, and what it "
                "wrote since is not used"
            )
            raise self.lost
        if o["released"]:
            raise StoreError(f"run {self.id} was released by this process; acquire it again")

    def renew(self) -> None:
        self._transact("renew", lambda d: d)
        drill.at(drill.CONTROL_RENEW)

    def publish(self, updates: dict[str, list[str] | None], what: str = "publish") -> None:
        """Set (or, with None, drop) pointers, fenced by this owner's generation."""

        def change(d: dict[str, Any]) -> dict[str, Any] | None:
            if d["status"] == "complete":
                raise RunComplete(f"run {self.id} is complete and read-only")
            ptrs = d["pointers"]
            before = dict(ptrs)
            for name, value in updates.items():
                if value:
                    ptrs[name] = value
                else:
                    ptrs.pop(name, None)
            return d if ptrs != before else None

        self._transact(what, change)
        drill.at(drill.CONTROL_PUBLISH)

    def complete(self) -> None:
        """The one fenced transition after which the run is read-only."""

        def change(d: dict[str, Any]) -> dict[str, Any] | None:
            if d["status"] == "complete":
                return None
            d["status"] = "complete"
            d["lease"]["expires"] = time.time()
            d["owner"]["released"] = True
            return d

        self.stop_heartbeat()
        self._transact("complete", change)
        drill.at(drill.CONTROL_COMPLETE)

    def release(self) -> None:
        """Give the run up (a stop, an error): a successor may acquire at once."""
        self.stop_heartbeat()
        if self.lost is not None or self.doc["owner"]["released"]:
            return

        def change(d: dict[str, Any]) -> dict[str, Any] | None:
            d["owner"]["released"] = True
            d["lease"]["expires"] = time.time()
            return d

        try:
            self._transact("release", change)
        except (Superseded, StoreError) as e:
            log.info("releasing run %s: %s", self.id, e)

    # heartbeat

    def start_heartbeat(self, on_lost: Callable[[Superseded], None] | None = None) -> None:
        if self._beat is not None:
            return
        self._stop.clear()

        def beat() -> None:
            while not self._stop.wait(self.lease / 3):
                try:
                    self.renew()
                except Superseded as e:
                    log.warning("%s", e)
                    if on_lost is not None:
                        on_lost(e)
                    return
                except (StoreError, OSError) as e:  # a passing network problem: next beat
                    log.warning("renewing the lease of run %s: %s", self.id, e)

        self._beat = threading.Thread(target=beat, name=f"spill-lease-{self.id}", daemon=True)
        self._beat.start()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        beat, self._beat = self._beat, None
        if beat is not None and beat is not threading.current_thread():
            beat.join(timeout=5)


def _fresh(run: str, owner: dict, lease: float, home: str, parent: str | None,
           pointers: dict, generation: int) -> dict[str, Any]:
    now = time.time()
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": "spill-control",
        "run": run,
        "status": "active",
        "generation": generation,
        "seq": 1,
        "owner": owner,
        "lease": {"seconds": lease, "expires": now + lease},
        "home": home,
        "pointers": pointers,
        "lineage": {"parent": parent, "copied_from": None},
        "last": {"op": f"{owner['nonce']}:0", "what": "create", "at": now},
        "created": _iso(now),
        "updated": _iso(now),
    }


def _holder(doc: dict[str, Any], nonce: str, now: float) -> bool:
    """Whether ``doc``'s owner still holds the run against us."""
    o = doc["owner"]
    if o["nonce"] == nonce or o["released"]:
        return False
    if doc["lease"]["expires"] <= now:
        return False
    return not gone(o)


def _busy(doc: dict[str, Any], state: str, extra: str = "") -> Busy:
    return Busy(
        f"run {doc['run']} at {state} is held by {describe(doc)}{extra}; try again later, "
        "or add --wait to wait for it"
    )


def acquire(
    state: str,
    *,
    lease: float | None = None,
    wait: bool = False,
    new_run: bool = False,
    poll: float = 0.5,
) -> Run:
    """Own the current run at ``state`` (creating the first one), at its next generation.

    ``new_run``: when the current run is complete, start a new run whose lineage names it (a
    build whose inputs changed after completion). Without it a complete run raises
    ``RunComplete``. A held run raises ``Busy`` unless ``wait``, which polls until it is free.
    """
    lease = lease_seconds(lease)
    store = store_for(state)
    nonce = secrets.token_hex(16)
    while True:
        try:
            run = _try_acquire(store, nonce, lease, new_run)
        except Busy:
            if not wait:
                raise
            time.sleep(poll)
            continue
        drill.at(drill.CONTROL_ACQUIRE)
        return run


def _try_acquire(store: _Store, nonce: str, lease: float, new_run: bool) -> Run:
    home = home_of(store.state)
    for _ in range(ATTEMPTS):
        with store.exclusive():
            runs, runs_tag = _read_runs(store)
            now = time.time()
            if runs is None or new_run and _complete(store, runs):
                parent = None if runs is None else _read_control(store, runs["current"])[0]
                rid = _new_run_id()
                gen = parent["generation"] + 1 if parent else 1
                ptrs = dict(parent["pointers"]) if parent else {}
                doc = _fresh(rid, me(nonce), lease, home, parent and parent["run"], ptrs, gen)
                validate(doc, "control", where=store.uri(f"{rid}/{CONTROL}"))
                # the run's control object first (a new key, no contention), then the list
                try:
                    store.write(f"{rid}/{CONTROL}", _dump(doc), None)
                    listing = {
                        "schema_version": SCHEMA_VERSION,
                        "kind": "spill-runs",
                        "current": rid,
                        "runs": [*(runs["runs"] if runs else []), rid],
                    }
                    validate(listing, "runs", where=store.uri(CURRENT))
                    store.write(CURRENT, _dump(listing), runs_tag)
                except (_Conflict, _Uncertain):
                    got, _ = _read_runs(store)
                    if got is not None and got["current"] == rid:
                        return Run(store, doc, lease)
                    continue  # someone else started a run here first: compete for theirs
                return Run(store, doc, lease)
            rid = runs["current"]
            doc, tag = _read_control(store, rid)
            if doc is None:
                raise StoreError(
                    f"{store.uri(CURRENT)} names run {rid}, which has no control object; the "
                    "state was copied incompletely"
                )
            if doc["status"] == "complete":
                raise RunComplete(f"run {rid} at {store.state} is complete and read-only")
            if doc["status"] in ("transferred",):
                raise StoreError(f"run {rid} was moved away from {store.state}; continue it there")
            if doc["home"] != home:
                _check_copy(doc, home)
            if _holder(doc, nonce, now):
                raise _busy(doc, store.state)
            new = json.loads(json.dumps(doc))
            new.update(generation=doc["generation"] + 1, seq=doc["seq"] + 1, status="active")
            new["owner"] = me(nonce)
            new["lease"] = {"seconds": lease, "expires": now + lease}
            if doc["home"] != home:
                new["lineage"]["copied_from"] = doc["home"]
                new["home"] = home
            new["last"] = {"op": f"{nonce}:0", "what": "acquire", "at": now}
            new["updated"] = _iso(now)
            validate(new, "control", where=store.uri(f"{rid}/{CONTROL}"))
            try:
                store.write(f"{rid}/{CONTROL}", _dump(new), tag)
            except (_Conflict, _Uncertain):
                got, _ = _read_control(store, rid)
                if got is not None and got["last"]["op"] == f"{nonce}:0":
                    return Run(store, got, lease)
                continue
            return Run(store, new, lease)
    raise StoreError(f"{store.state}: could not acquire its run; try again")


def _complete(store: _Store, runs: dict[str, Any]) -> bool:
    doc, _ = _read_control(store, runs["current"])
    return doc is not None and doc["status"] == "complete"


def _check_copy(doc: dict[str, Any], home: str) -> None:
    """A state copied from elsewhere may not continue while the original's owner holds it."""
    where = doc["home"]
    if "://" in where:
        original = where
    else:
        hostname, _, original = where.partition(":")
        if hostname != host() or not os.path.isdir(original):
            return  # another machine, or moved away: the copied lease decides
    try:
        theirs = current(original)
    except (StoreError, OSError):
        return
    if theirs is not None and theirs["run"] == doc["run"] and _holder(theirs, "", time.time()):
        raise _busy(theirs, original, f" (this state at {home.split(':', 1)[-1]} is a copy of it)")


# --- a job's view: its folder, its pointers, its payloads --------------------------------------


class Place:
    """A job's part of a run: ``<state>/<prefix>`` and the pointers named ``<prefix>/<name>``.

    With a ``run`` it can allocate payloads and publish; without one it only reads the current
    control object (status, probes)."""

    def __init__(self, state: str, prefix: str = "", run: Run | None = None):
        self.state, self.prefix, self.run = state, prefix.strip("/"), run
        self._doc: dict[str, Any] | None = None

    @property
    def uri(self) -> str:
        return join(self.state, self.prefix) if self.prefix else self.state

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _rel(self, rel: str) -> str:
        return rel[len(self.prefix) + 1 :] if self.prefix else rel

    def doc(self) -> dict[str, Any] | None:
        if self.run is not None:
            return self.run.doc
        if self._doc is None:
            self._doc = current(self.state) or {}
        return self._doc or None

    def pointer(self, name: str) -> list[str]:
        """URIs of the payloads named ``name``, newest first (``[]`` when none)."""
        doc = self.doc()
        rels = (doc or {}).get("pointers", {}).get(self.key(name), [])
        return [join(self.state, r) for r in rels]

    def payload(self, kind: str, seq: int) -> str:
        """A new payload folder's URI: ``payloads/<kind>-g<gen>-s<seq>-<attempt>``."""
        assert self.run is not None, "a read-only place allocates no payloads"
        stem = f"{kind}-g{self.run.gen}-s{seq}-"
        taken = [n for n in listdir(join(self.uri, PAYLOADS)) if n.startswith(stem)]
        return join(self.uri, PAYLOADS, f"{stem}{len(taken)}")

    def publish(self, name: str, uris: list[str]) -> None:
        assert self.run is not None
        rels = [u[len(self.state) :].strip("/") for u in uris]
        self.run.publish({self.key(name): rels or None})

    def drop(self) -> None:
        """Drop every pointer under this place (its job state is cleared)."""
        assert self.run is not None
        doc = self.run.doc
        mine = [k for k in doc["pointers"] if not self.prefix or k.startswith(self.prefix + "/")]
        if mine:
            self.run.publish(dict.fromkeys(mine), "drop")

    def collect(self, kind: str, keep: set[str]) -> None:
        """Remove payloads of ``kind`` that no pointer of this run needs: those not in ``keep``
        (URIs) of generations up to ours. A later generation's payloads are never touched."""
        assert self.run is not None
        base = join(self.uri, PAYLOADS)
        for n in listdir(base):
            m = _PAYLOAD.fullmatch(n)
            uri = join(base, n)
            if m and m[1] == kind and int(m[2]) <= self.run.gen and uri not in keep:
                remove(uri)


def payload_seq(uri: str) -> int | None:
    """The ``s<seq>`` of a payload folder's name (a tune step, a segment number)."""
    m = _PAYLOAD.fullmatch(uri.rstrip("/").rsplit("/", 1)[-1])
    return int(m[3]) if m else None


@contextlib.contextmanager
def held(
    state: str,
    *,
    lease: float | None = None,
    wait: bool = False,
    on_lost: Callable[[Superseded], None] | None = None,
) -> Iterator[Run]:
    """Own the run at ``state`` for the block, heartbeat included; released when it ends,
    however it ends (a completed run stays complete)."""
    run = acquire(state, lease=lease, wait=wait)
    run.start_heartbeat(on_lost)
    try:
        yield run
    finally:
        run.release()
