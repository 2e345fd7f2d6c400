"""Shared parts of the authority drills: paused writers, control documents, pointed payloads.

A writer is paused with a real ``SIGSTOP`` (``SPILL_DRILL=<boundary>@k:stop``: the process stops
itself there). A stopped process keeps any ``flock`` it holds, and a local state's transitions
hold ``runs/control.lock`` for the few milliseconds of a write; a writer whose heartbeat thread
happens to be inside a renewal when it stops would hold every successor off until it continues.
``paused`` therefore lets such a writer run on a moment and stops it again until the lock is free.

Control documents are read through ``spill.control.keys.current``, so local and ``s3://`` states are
read the same way.
"""

from __future__ import annotations

import fcntl
import os
import signal
import time
from typing import Any

from spill.control.keys import current
from spill.control.place import _PAYLOAD
from spill.store import fs
from spill.store.location import location
from tests.func import tune_kit as kit


def doc(state: str) -> dict[str, Any]:
    """The current run's control document (``runs/<id>/control.json``)."""
    got = current(location(state))
    assert got is not None, f"{state} holds no run"
    return got


def pointed(control: dict[str, Any]) -> list[str]:
    """Every payload folder name the control document points at."""
    return sorted(r.rsplit("/", 1)[-1] for rels in control["pointers"].values() for r in rels)


def gen_seq(name: str) -> tuple[int, int]:
    """``(generation, seq)`` of a payload folder's name."""
    m = _PAYLOAD.fullmatch(name)
    assert m, name
    return int(m[2]), int(m[3])


def payloads(state: str) -> list[str]:
    return sorted(fs.listdir(fs.join(state, "payloads")))


def _lock_free(state: str) -> bool:
    """Whether nobody holds the local state's ``runs/control.lock`` (true on object stores)."""
    if not fs.is_local(state):
        return True
    path = os.path.join(state, "runs", "control.lock")
    if not os.path.exists(path):
        return True
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)  # closing releases the probe's own lock
    return True


def wait_stopped(pid: int) -> None:
    _, status = os.waitpid(pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), f"pid {pid} ended (status {status}) instead of stopping"


def paused(argv: list[str], env: dict, drill: str, state: str) -> kit.Worker:
    """A tune process that stopped itself at ``drill`` (``<boundary>@k``), holding no lock."""
    w = kit.Worker(argv, {**env, "SPILL_DRILL": f"{drill}:stop"})
    wait_stopped(w.proc.pid)
    while not _lock_free(state):  # stopped inside a renewal: let it finish the write
        w.proc.send_signal(signal.SIGCONT)
        time.sleep(0.01)
        w.proc.send_signal(signal.SIGSTOP)
        wait_stopped(w.proc.pid)
    return w


def wait_past_lease(state: str) -> dict[str, Any]:
    """Sleep until the current owner's lease has expired; the document it expired in."""
    while True:
        d = doc(state)
        left = d["lease"]["expires"] - time.time()
        if left < 0:
            return d
        time.sleep(left + 0.05)


def last_line(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.strip()]
    assert lines, "nothing on stderr"
    return lines[-1]
