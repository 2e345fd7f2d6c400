"""One job over several processes (``torchrun ... -m spill tune``, ``spill tune --procs N``,
``mlx.launch ... -m spill tune``): the process group as a job sees it (``current``, ``Group``).

The ranks share a step's work, never the run's state: rank 0 alone holds the run, commits and
prints. Every world size takes the same steps bit for bit, and a run continues at any world size. A
rank that dies ends the others' next collective: ``GroupLost``, exit 75, nothing half-published
(only rank 0 commits, atomically); rerun the command at any world size to continue from the last
commit.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from spill import console
from spill.errors import EXIT_PREEMPTED, SpillError
from spill.jobs.preempt import request_stop, stop_agreed, stop_requested
from spill.store import drill

if TYPE_CHECKING:
    import numpy as np

ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK")  # what torchrun (and torch's launcher) sets
MLX_ENV = "MLX_RANK"  # what mlx.launch sets, whatever its backend (ring, nccl, jaccl)
TIMEOUT_ENV, TIMEOUT = "SPILL_GROUP_TIMEOUT", 1800.0  # seconds one collective may wait
PARENT_ENV = "SPILL_LAUNCHER_PID"  # set by ``--procs``: the ranks' launcher, their parent
SAID_ENV = "SPILL_GROUP_SAID"  # set by ``--procs``: the file whose creation claims the loss's line


# Rank 0 leads: it alone holds the run, reads and commits checkpoints and prints; it hands the
# others the adapter and moments it starts from (``start``), and every step the ranks agree whether
# to stop (``stop_wanted``), so all of them stop at the same boundary. Each rank opens its own ring
# (``--memory`` is per rank; ranks on one host share the page cache) and computes the micro-batches
# ``j`` with ``j % world == rank``; one all-gather (``gather``) then gives every rank every
# micro-batch's gradients, which it folds in micro-batch order: the order one process adds them in.
class GroupLost(SpillError):
    """Another process of the job stopped or died: this one stops too, committing nothing."""

    exit_code = EXIT_PREEMPTED


def lost(rank: int | None, why: str) -> str:
    """``GroupLost``'s line, said for ``rank`` (None: ``--procs``'s launcher, for its ranks)."""
    who = "the launcher" if rank is None else f"rank {rank}"
    return (
        f"{who}: another process of this job is gone ({why}); nothing half-published: "
        "run the same command (any --procs) to continue from the last commit"
    )


# A launcher ends the rest of a job as soon as one rank exits (torch's SIGTERMs them), so the rank
# that finds the group lost says its line at once, before it winds down; under ``--procs`` the job
# says it once: the first rank to claim ``SPILL_GROUP_SAID`` (a file) says it, and the launcher says
# it where a rank died and none could (``spill.jobs.launch``).
def say_lost(line: str) -> None:
    """``line`` (``lost``'s) on stderr as the CLI says an error, unbuffered (a watchdog's
    ``_exit`` or the launcher's SIGTERM may follow): once per job under ``--procs`` (the rank
    that creates ``SAID_ENV``'s file, which then reads ``said``), by every rank otherwise."""
    path = os.environ.get(SAID_ENV)
    try:
        claim = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY) if path else None
    except FileExistsError:
        return  # another rank said it
    except OSError:
        claim = None  # (its folder gone: say it anyway)
    os.write(2, f"spill: error: {line}\n".encode())
    if claim is not None:
        os.write(claim, b"said")
        os.close(claim)


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
    exchange: object = field(default=None, repr=False)  # the launcher's dist module
    watchdog: Watchdog | None = field(default=None, repr=False)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def mine(self, n: int) -> range:
        """The indices of ``n`` micro-batches this rank computes."""
        return range(self.rank, n, self.world)

    # --- collectives (each one is called by every rank, in the same order) -------------------

    def _call(self, what, *args, say: bool = True):
        """``what(*args)``, the exchange's collective; a peer gone is ``GroupLost``, its line
        said here unless ``say`` is false (a caller that expects the loss and swallows it)."""
        if self.world == 1:
            raise AssertionError("a world of one process exchanges nothing")
        try:
            with self.watchdog or nullcontext():
                return what(*args)
        except RuntimeError as e:  # gloo, MLX's ring: a peer closed its connection, timed out
            text = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip()).split(". ")[0]  # gloo's file:line
            why = text.splitlines()[0][:160] if text else type(e).__name__
        error = GroupLost(lost(self.rank, why))
        if say:  # now: the launcher may end this process before the error reaches the CLI
            drill.at(drill.GROUP_LOST)
            say_lost(str(error))
            error.said = True
        raise error

    def share(self, payload=None):
        """Rank 0's ``payload`` on every rank (the others pass nothing)."""
        return self._call(self.exchange.share, payload if self.leader else None)

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
                self._call(self.exchange.share, shared, say=False)
            except GroupLost:
                pass  # the others are gone: rank 0's own error is the line

    def boundary(self, guard) -> None:
        """Between quanta (a job's ``Guard``): stop (save, exit 75) when asked; in a group, all
        ranks stop at the same boundary when any one was asked."""
        if self.world == 1:
            guard.boundary()
            return
        t0 = time.perf_counter()
        wanted = self.stop_wanted(stop_requested() is not None)
        self.waited += time.perf_counter() - t0
        if wanted:
            if stop_requested() is None:
                request_stop("a stop of another process of this job")
            try:
                guard.boundary()  # rank 0 commits; every rank raises Preempted
            finally:
                self._together()
                stop_agreed()

    def _together(self) -> None:
        """Every rank waits here for the others (rank 0's commit): a launcher stops the rest of
        a job when one rank exits, so none exits before rank 0 has committed and said so."""
        try:
            self._call(self.exchange.any_of, False, say=False)
        except GroupLost:
            pass  # gone already: its exit is what was waited for

    def stop_wanted(self, mine: bool) -> bool:
        """Whether any rank was asked to stop (one all-reduce)."""
        return self._call(self.exchange.any_of, mine)

    def gather(
        self,
        done: list[tuple[int, float, int, np.ndarray]],
        n: int,
        size: int,
        device: str = "cpu",
    ):
        """Every rank's ``(j, loss, tokens, grads)`` of its micro-batches, in ``j`` order, on
        every rank; ``n``: the step's micro-batches, ``size``: the gradient vector's length,
        ``device``: where the job computes (the exchange may use it: NCCL on CUDA)."""
        import numpy as np  # lazy: numpy, off the CLI's start

        slots = -(-n // self.world)  # the most micro-batches any rank computed
        meta = np.full((slots, 3), -1.0, dtype=np.float64)
        grads = np.zeros((slots, size), dtype=np.float32)
        for s, (j, loss, tokens, flat) in enumerate(done):
            meta[s] = (j, loss, tokens)
            grads[s] = flat
        t0 = time.perf_counter()
        metas, all_grads = self._call(self.exchange.gather_rows, meta, grads, self.world, device)
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
        t0 = time.perf_counter()
        out = self._call(self.exchange.collect, value, self.world)
        self.waited += time.perf_counter() - t0
        return out

    def total(self, n: int | float):
        """``n`` summed over the ranks (``n`` itself in a world of one)."""
        return sum(self.collect(n)) if self.world > 1 else n

    def close(self) -> None:
        if self.world > 1:
            self.exchange.leave()


# An exchange that cannot notice a peer that stops answering (``TIMES_OUT`` false: MLX's ring) is
# bounded by a watchdog that ends the process with the same line after ``SPILL_GROUP_TIMEOUT``
# seconds in one collective.
class Watchdog:
    """Bounds each collective of an exchange that would wait forever for a peer that stopped
    answering (``TIMES_OUT`` false: MLX's ring notices a closed connection, not a silent one).
    The collective is native code with the GIL released, so only another thread can act: after
    ``seconds`` in one collective it says ``GroupLost``'s line and ends the process, exit 75."""

    def __init__(self, rank: int, seconds: float) -> None:
        self.rank, self.seconds = rank, seconds
        self.since: float | None = None  # time.monotonic() when the collective began
        threading.Thread(target=self._watch, daemon=True, name="spill-group-watchdog").start()

    def __enter__(self) -> None:
        self.since = time.monotonic()

    def __exit__(self, *exc) -> None:
        self.since = None

    def _watch(self) -> None:
        while True:
            time.sleep(min(1.0, self.seconds / 4))
            since = self.since
            if since is not None and time.monotonic() - since > self.seconds:
                say_lost(lost(self.rank, f"no answer in {self.seconds:g} s"))
                os._exit(EXIT_PREEMPTED)


def launcher() -> str | None:
    """Which launcher started this process as a rank of several: ``"mlx.launch"``
    (``MLX_RANK``), ``"torchrun"`` (``WORLD_SIZE`` > 1: torchrun, ``--procs``), or None."""
    if os.environ.get(MLX_ENV) is not None:
        return "mlx.launch"
    if int(os.environ.get("WORLD_SIZE") or 1) > 1:
        return "torchrun"
    return None


# A rank that spill's own launcher started (``--procs``: ``SPILL_LAUNCHER_PID`` names it) dies with
# it: on Linux it asks for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``) and checks the parent
# did not die before it asked, so a SIGKILLed launcher leaves no rank running, and rank 0 holding
# the run: each stops at its next step (rank 0 commits and lets the run go), or by the stop's
# deadline. Ranks that torchrun or mlx.launch started are theirs to end.
def die_with_launcher() -> None:
    """A rank of ``--procs`` (``PARENT_ENV`` set): SIGTERM when its launcher dies (Linux's
    parent-death signal; the launcher starts its ranks from its main thread, so it is the
    process's death, not a thread's); a launcher already gone ends the rank at once."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1  # <linux/prctl.h>
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        return  # (a kernel without it: the launcher's stop is all there is)
    if os.getppid() != int(parent):  # it died before the request: no signal will come
        raise GroupLost(lost(int(os.environ.get("RANK") or 0), "its launcher is gone"))


# The launcher picks the exchange, once (``current``): torch's (torchrun, ``--procs``) goes over
# torch.distributed (gloo in host memory; NCCL for the gradients when every rank computes on a GPU
# of its own), mlx.launch's over ``mx.distributed``; both behind one small interface (``join``,
# ``share``, ``any_of``, ``gather_rows``, ``collect``, ``leave``: ``spill.engines.torch.dist``,
# ``spill.engines.mlx.dist``).
def _exchange(name: str):
    """The exchange of the launcher ``name``: the one place that chooses between them."""
    if name == "mlx.launch":
        from spill.engines.mlx import dist  # lazy: the engine, only where it runs
    else:
        from spill.engines.torch import dist  # lazy: the engine, only where it runs
    return dist


_current: Group | None = None


def current() -> Group:
    """This process's group: one process unless a launcher started it as a rank (``launcher``),
    then joined once through that launcher's exchange (rendezvous from its environment)."""
    global _current
    if _current is not None:
        return _current
    name = launcher()
    if name is None:
        _current = Group()
        return _current
    die_with_launcher()
    exchange = _exchange(name)
    seconds = float(os.environ.get(TIMEOUT_ENV) or TIMEOUT)
    watchdog = None if exchange.TIMES_OUT else Watchdog(int(os.environ.get(MLX_ENV) or 0), seconds)
    with watchdog or nullcontext():  # a peer that never arrives
        rank, world = exchange.join(seconds)
    if world <= 1:
        _current = Group()
        return _current
    local = int(os.environ.get("LOCAL_RANK") or 0)
    _current = Group(rank, world, local, exchange=exchange, watchdog=watchdog)
    if rank != 0:
        console.quiet()  # rank 0 speaks for the job
    return _current
