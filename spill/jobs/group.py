"""One job over several processes (``torchrun ... -m spill tune``, ``spill tune --procs N``):
the process group as a job sees it.

The processes (ranks) share a step's work, never the run's state. Rank 0 leads: it alone holds
the run, reads and commits checkpoints and prints; it hands the others the adapter and moments
it starts from (``start``), and every step the ranks agree whether to stop (``stop_wanted``), so
all of them stop at the same boundary. Each rank opens its own ring (``--memory`` is per rank;
ranks on one host share the page cache) and computes the micro-batches ``j`` with
``j % world == rank``; one all-gather (``gather``) then gives every rank every micro-batch's
gradients, which it folds in micro-batch order: the order one process adds them in. So every
world size takes the same steps bit for bit, and a run continues at any world size.

The exchange goes through host memory over gloo (float32 numpy from the engine's kernel),
whichever engine and device compute. A rank that dies ends the others' next collective:
``GroupLost``, exit 75, nothing half-published (only rank 0 commits, atomically); rerun the
command at any world size to continue from the last commit.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spill.errors import EXIT_PREEMPTED, SpillError

if TYPE_CHECKING:
    import numpy as np

ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK")  # what torchrun (and torch's launcher) sets


class GroupLost(SpillError):
    """Another process of the job stopped or died: this one stops too, committing nothing."""

    exit_code = EXIT_PREEMPTED


class Refused(SpillError):
    """The leader refused the job before its first step; the others stop with its exit code
    without repeating its line."""

    said = True


@dataclass
class Group:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    started: bool = field(default=False, repr=False)
    waited: float = field(default=0.0, repr=False)  # seconds in collectives, waiting included

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def mine(self, n: int) -> range:
        """The indices of ``n`` micro-batches this rank computes."""
        return range(self.rank, n, self.world)

    # --- collectives (each one is called by every rank, in the same order) -------------------

    def _call(self, what, *args):
        if self.world == 1:
            raise AssertionError("a world of one process exchanges nothing")
        try:
            return what(*args)
        except RuntimeError as e:  # gloo: a peer closed its connection or timed out
            text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". ")[0]  # gloo's file:line
            line = text.splitlines()[0][:160] if text else type(e).__name__
            raise GroupLost(
                f"rank {self.rank}: another process of this job is gone ({line}); nothing "
                "half-published: run the same command (any --procs) to continue from the last "
                "commit"
            ) from None

    def share(self, payload=None):
        """Rank 0's ``payload`` on every rank (the others pass nothing)."""
        from spill.engines.torch import dist

        return self._call(dist.share, payload if self.leader else None)

    def new_job(self) -> None:
        """Rank 0 begins a job (a build runs several): until its ``start`` a refusal is shared."""
        self.started = False

    def start(self, payload) -> object:
        """Rank 0 hands a job's ``payload`` to every rank (the others pass None and get it); a
        ``SpillError`` payload (rank 0 refused the job) is raised on the others, quietly."""
        got = self.share(payload)
        self.started = True
        if isinstance(got, SpillError) and not self.leader:
            refused = Refused(str(got))
            refused.exit_code = got.exit_code
            raise refused
        return got

    def refuse(self, error: BaseException) -> None:
        """Rank 0 failed before ``start``: tell the others (they stop with its exit code)."""
        if self.world > 1 and self.leader and not self.started:
            code = getattr(error, "exit_code", 1)
            shared = SpillError(str(error) or type(error).__name__)
            shared.exit_code = code
            try:
                self.start(shared)
            except GroupLost:
                pass

    def boundary(self, guard) -> None:
        """Between quanta (a job's ``Guard``): stop (save, exit 75) when asked; in a group, all
        ranks stop at the same boundary when any one was asked."""
        from spill.jobs.preempt import request_stop, stop_requested

        if self.world == 1:
            guard.boundary()
            return
        t0 = time.perf_counter()
        wanted = self.stop_wanted(stop_requested() is not None)
        self.waited += time.perf_counter() - t0
        if wanted:
            if stop_requested() is None:
                request_stop("a stop of another process of this job")
            guard.boundary()

    def stop_wanted(self, mine: bool) -> bool:
        """Whether any rank was asked to stop (one all-reduce)."""
        from spill.engines.torch import dist

        return self._call(dist.any_of, mine)

    def gather(self, done: list[tuple[int, float, int, np.ndarray]], n: int, size: int):
        """Every rank's ``(j, loss, tokens, grads)`` of its micro-batches, in ``j`` order, on
        every rank; ``n``: the step's micro-batches, ``size``: the gradient vector's length."""
        import numpy as np

        from spill.engines.torch import dist

        slots = -(-n // self.world)  # the most micro-batches any rank computed
        meta = np.full((slots, 3), -1.0, dtype=np.float64)
        grads = np.zeros((slots, size), dtype=np.float32)
        for s, (j, loss, tokens, flat) in enumerate(done):
            meta[s] = (j, loss, tokens)
            grads[s] = flat
        t0 = time.perf_counter()
        metas, all_grads = self._call(dist.gather_rows, meta, grads, self.world)
        self.waited += time.perf_counter() - t0
        out = []
        for r in range(self.world):
            for s in range(slots):
                j, loss, tokens = metas[r][s].tolist()
                if j >= 0:
                    out.append((int(j), loss, int(tokens), all_grads[r][s]))
        return sorted(out, key=lambda row: row[0])

    def collect(self, value) -> list:
        """Every rank's ``value`` (picklable), by rank, on every rank."""
        from spill.engines.torch import dist

        t0 = time.perf_counter()
        out = self._call(dist.collect, value, self.world)
        self.waited += time.perf_counter() - t0
        return out

    def total(self, n: int | float):
        """``n`` summed over the ranks (``n`` itself in a world of one)."""
        return sum(self.collect(n)) if self.world > 1 else n

    def close(self) -> None:
        if self.world > 1:
            from spill.engines.torch import dist

            dist.leave()


_current: Group | None = None


def current() -> Group:
    """This process's group: one process unless torchrun (or ``--procs``) started it as a rank
    (``WORLD_SIZE`` > 1), then joined once over gloo (rendezvous from torchrun's env)."""
    global _current
    if _current is not None:
        return _current
    world = int(os.environ.get("WORLD_SIZE") or 1)
    if world <= 1:
        _current = Group()
        return _current
    from spill.engines.torch import dist

    rank = int(os.environ["RANK"])
    dist.join(float(os.environ.get("SPILL_GROUP_TIMEOUT") or 1800))
    _current = Group(rank=rank, world=world, local_rank=int(os.environ.get("LOCAL_RANK") or 0))
    if rank != 0:
        from spill import console

        console.quiet()  # rank 0 speaks for the job
    return _current
