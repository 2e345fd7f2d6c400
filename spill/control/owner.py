"""Who owns a run: this process's identity (host, boot id, pid and its start time, a nonce),
whether a recorded owner is provably gone, and the lease length.

An owner is *gone* only when that can be proven: the same host and boot, and its pid is not
running (or is a zombie, or now belongs to a process that started at another time). Anything
else (another host, another boot, no boot id) is decided by the lease alone.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
import time
from typing import Any

from spill.errors import StoreError
from spill.store.location import Location

LEASE = 120.0
LEASE_ENV = "SPILL_LEASE"


@functools.cache
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()[:64]
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "kern.boottime"], capture_output=True, text=True)
            m = re.search(r"sec = (\d+)", out.stdout)
            return f"darwin-{m[1]}" if m else ""
        except OSError:
            return ""
    return ""


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the command name (``[]`` where unknown): [0] is
    the state (``Z`` a zombie), [19] the start time in clock ticks since boot."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return []
    return text[text.rfind(")") + 2 :].split()


def _pid_state(pid: int) -> str:
    """``Z`` for a zombie, ``R``, ``S``... (``""`` where unknown)."""
    return (_stat(pid) or [""])[0]


def _start_time(fields: list[str]) -> str:
    return fields[19] if len(fields) > 19 else ""


def host() -> str:
    return socket.gethostname()


def me(nonce: str) -> dict[str, Any]:
    pid = os.getpid()
    return {
        "host": host(),
        "boot": _boot_id(),
        "pid": pid,
        "start": _start_time(_stat(pid)),
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
    fields = _stat(pid)
    if fields[:1] in (["Z"], ["X"]):
        return True
    return bool(owner["start"]) and _start_time(fields) not in ("", owner["start"])


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
    lease = (
        "released"
        if o["released"]
        else (f"lease {left:.0f} s left" if left > 0 else "lease expired")
    )
    return f"{o['host']} pid {o['pid']} since {since}, {lease}"


def home_of(state: Location) -> str:
    """Where a state location is, as recorded in its runs: ``host:/real/path`` or the URI."""
    return state.home(host())
