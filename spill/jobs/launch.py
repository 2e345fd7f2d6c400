"""``spill tune --procs N`` (``launch``): the same command as N processes on this host, started by
torch's own elastic launcher (what ``torchrun --standalone --nproc-per-node N -m spill ...`` runs),
each one a rank of ``spill.jobs.group``.

The launcher's exit status is the job's: 0 when every rank finished; 75 when the job stopped (a
signal, a lost rank) and rank 0's last commit stands, so the same command, at any ``--procs``,
continues; otherwise the failing ranks' status. Every socket is on loopback
(``spill.engines.torch.dist``), and the ranks die with the launcher (``group.die_with_launcher``).
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Sequence
from pathlib import Path

from spill.errors import EXIT_PREEMPTED, UsageError
from spill.jobs.group import PARENT_ENV, SAID_ENV, launcher, lost, say_lost


def without_procs(argv: Sequence[str]) -> list[str]:
    """``argv`` less its ``--procs N`` (or ``--procs=N``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--procs":
            skip = True
        elif not a.startswith("--procs="):
            out.append(a)
    return out


# Each rank computes on one thread unless ``OMP_NUM_THREADS`` says otherwise (as torchrun does).
def launch(procs: int, argv: Sequence[str]) -> int:
    """Run ``spill *argv`` as ``procs`` ranks; returns the job's exit status."""
    if procs < 1:
        raise UsageError("--procs must be at least 1")
    if (started := launcher()) is not None:
        raise UsageError(
            f"--procs inside {started}: {started} already started the processes; drop --procs"
        )
    from spill.engines.torch import dist  # lazy: the engine, only where it runs

    os.environ[PARENT_ENV] = str(os.getpid())  # the ranks' parent: they die with it
    with tempfile.TemporaryDirectory(prefix="spill-procs-") as work:
        said = Path(work) / "said"
        os.environ[SAID_ENV] = str(said)
        try:
            failed = dist.launch(procs, without_procs(argv))
        except dist.Stopped:
            return EXIT_PREEMPTED  # the ranks were handed the signal: rank 0 saved and said so
        finally:
            del os.environ[SAID_ENV]
        if failed is None:
            return 0
        status = _status(list(failed.values()))
        if status == EXIT_PREEMPTED and (line := unsaid_loss(failed, procs, said)):
            say_lost(line)
    return status


# A rank that dies is said in one line, once: by the rank that found it gone (the first to claim
# ``SPILL_GROUP_SAID``, a file of the launcher's) or, where torch's teardown ended the others before
# any could, by the launcher (``unsaid_loss``).
def unsaid_loss(failed: dict[int, int], procs: int, said: Path) -> str | None:
    """The line of a job that lost a rank (``failed``: exit codes by rank, a signal's negative)
    where no rank said it (``said`` never read ``said``): torch's teardown SIGTERMs every other
    rank once one exits, and may end them before they notice. None when no rank died of a
    signal, or one rank said it, or there was no other rank to lose."""
    dead = {rank: code for rank, code in failed.items() if code < 0}
    if procs < 2 or not dead or (said.exists() and said.read_bytes() == b"said"):
        return None
    return lost(None, ", ".join(f"rank {r} ended by {_signal(-c)}" for r, c in dead.items()))


def _signal(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _status(codes: list[int]) -> int:
    """The job's status from its failed ranks': a rank killed by a signal, or stopped (75),
    leaves rank 0's last commit standing (75); any other failure is the job's."""
    other = [c for c in codes if c > 0 and c != EXIT_PREEMPTED]
    return other[0] if other else EXIT_PREEMPTED
