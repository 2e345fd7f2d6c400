"""A build as a rank other than 0 (``spill build --procs N``, ``engine.procs``, torchrun): it
runs each job that rank 0's build runs, as that job's other rank, and records nothing. Rank 0
plans, holds the run and records every stage (``spill.project.build.execute``).

Rank 0 shares, in order: the build's context (project, state, prepared data) before its first
job, each job's decision right before the job, and None when the build is over. A rank 0 that
fails between jobs ends this rank's wait (``GroupLost``, exit 75); one that refuses a job before
its first step shares the refusal (``spill.jobs.group``).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from spill.jobs.group import Group


class Relaunch(Exception):  # noqa: N818 - control flow, not an error
    """The build asks for ``args[0]`` processes and runs as one: start it again under torch's
    elastic launcher (the command line does)."""


def context_of(ctx) -> dict:
    """What the other ranks need of rank 0's ``BuildContext`` to run its jobs."""
    return {
        "project": ctx.project,
        "root": ctx.root,  # a Location, pickled whole
        "prepared": ctx.prepared,
        "data_sha": ctx.data_sha,
        "key": ctx.key,
    }


def follow(group: Group) -> dict:
    from spill.engines.core import heap
    from spill.project.build.context import BuildContext
    from spill.project.build.stages import get

    with tempfile.TemporaryDirectory(prefix="spill-build-") as work:
        ctx = None
        while (msg := group.share()) is not None:
            kind, value = msg
            if kind == "context":
                ctx = BuildContext(**value)
                ctx.work = Path(work)
                if ctx.under_budget():  # as rank 0 does before its first job
                    heap.bound_shape_caches()
                for name, data in ctx.prepared.files().items():
                    (ctx.work / name).write_bytes(data)
            else:
                get(value.stage).execute(ctx, value.stop)
                heap.release()  # as rank 0 does between its stages
    return {"rank": group.rank}
