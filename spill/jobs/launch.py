"""``spill tune --procs N``: the same command as N processes on this host, started by torch's own
elastic launcher (what ``torchrun --standalone --nproc-per-node N -m spill ...`` runs), each one
a rank of ``spill.jobs.group``.

The launcher's exit status is the job's: 0 when every rank finished; 75 when the job stopped
(a signal, a lost rank) and rank 0's last commit stands, so the same command, at any ``--procs``,
continues; otherwise the failing ranks' status. Each rank computes on one thread unless
``OMP_NUM_THREADS`` says otherwise (as torchrun does). Every socket the launcher and its ranks
listen on is on loopback (``spill.engines.torch.dist``), and the ranks die with the launcher
(``spill.jobs.group.die_with_launcher``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from spill.errors import EXIT_PREEMPTED, UsageError
from spill.jobs.group import PARENT_ENV, launcher


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


def launch(procs: int, argv: Sequence[str]) -> int:
    """Run ``spill *argv`` as ``procs`` ranks; returns the job's exit status."""
    if procs < 1:
        raise UsageError("--procs must be at least 1")
    if (started := launcher()) is not None:
        raise UsageError(
            f"--procs inside {started}: {started} already started the processes; drop --procs"
        )
    from spill.engines.torch import dist

    os.environ[PARENT_ENV] = str(os.getpid())  # the ranks' parent: they die with it
    try:
        failed = dist.launch(procs, without_procs(argv))
    except dist.Stopped:
        return EXIT_PREEMPTED  # the ranks were handed the signal: rank 0 saved and said so
    return 0 if failed is None else _status(failed)


def _status(codes: list[int]) -> int:
    """The job's status from its failed ranks': a rank killed by a signal, or stopped (75),
    leaves rank 0's last commit standing (75); any other failure is the job's."""
    other = [c for c in codes if c > 0 and c != EXIT_PREEMPTED]
    return other[0] if other else EXIT_PREEMPTED
