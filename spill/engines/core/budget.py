"""What ``--memory M`` promises, and where M comes from when nobody gives one (``resolve``).

M (bytes) is the process's budget beside a fixed ``RUNTIME``: the resident parts (embeddings, final
norm, lm_head), the ring's layers, a tune's state, activations and the batch, and the page cache its
reads and writes cause. The process's peak, anonymous memory plus the page cache it causes (a
cgroup's ``max_usage``), stays under M + ``RUNTIME`` (docs/memory.md). Without ``--memory``, a
cgroup limit below the machine's RAM sets M; otherwise there is no promise.
"""

from __future__ import annotations

from dataclasses import dataclass

from spill.errors import EngineError
from spill.ground.machine import memory_limit, physical_memory
from spill.models.config import ModelConfig

# RUNTIME is the interpreter, torch or MLX, numpy, the tokenizer, what a tune imports and writes at
# its end: measured at about 160 MiB for a run of a tiny model, 303 MiB for a tune of one and 324
# MiB for SmolLM2's (docs/memory.md). Under a budget the reader (``core.reader``) and the store
# (``store.written``) drop the page cache behind themselves.
RUNTIME = 384 << 20  # the process beside its budget (docs/memory.md states it, a test measures it)
MIB = 1 << 20

# A build's stages share one process. RUNTIME counts a job's own process, and the most one was
# measured to take is 324 MiB (SmolLM2's tune), so SLACK of it is left over. What earlier jobs
# left held above where the process stood before its first one (the modules a tune imported, the
# shape caches' entries, the heap's fragments: 56 MiB before the README build's tune, 113 MiB
# before its last eval after 4 tune steps) rides in SLACK; the rest comes out of each later job's
# M (``carry``), so the build's peak stays under M + RUNTIME as a single job's does.
SLACK = 60 << 20
_carried = 0


@dataclass(frozen=True)
class Budget:
    """M in bytes (None: no promise, free RAM decides) and where it came from."""

    total: int | None
    source: str = ""  # "--memory", "cgroup limit 600 MiB less 384 MiB for the runtime"

    def words(self) -> str:
        """The pre-run line's words: ``memory 144 MiB (cgroup limit ...)``; "" without M."""
        if self.total is None:
            return ""
        return f"memory {self.total / MIB:.0f} MiB ({self.source})"


# A cgroup limit below the machine's RAM (a Slurm job's ``--mem``, a container's limit) sets M to
# the limit less ``RUNTIME``: the ring sizes from it exactly as from ``--memory``, and the pre-run
# line says which. Otherwise there is no promise: free RAM sizes the ring, and the page cache is the
# kernel's business, as before.
def resolve(memory: int | None) -> Budget:
    """``--memory`` where given, else the cgroup's limit less ``RUNTIME`` where that is below
    the machine's RAM, else none; less what earlier jobs of the process left (``carry``)."""
    if memory is not None:
        total, source = memory, "--memory"
    else:
        limit = memory_limit()
        if limit is None or limit >= physical_memory():
            return Budget(None)
        total = limit - RUNTIME
        source = f"cgroup limit {limit / MIB:.0f} MiB less {RUNTIME // MIB} MiB for the runtime"
    if _carried:
        source += f", less {_carried / MIB:.0f} MiB held from earlier stages"
    return Budget(max(0, total - _carried), source)


def carry(held: int) -> None:
    """What the process holds from its earlier jobs, above where it stood before the first (a
    build's stages): ``resolve`` takes what ``SLACK`` does not hold out of M from now on."""
    global _carried
    _carried = max(0, held - SLACK)


def resident_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes of the parts that never stream: the embeddings and lm_head (one matrix when tied)."""
    head = cfg.vocab_size * cfg.hidden_size * itemsize
    return head * (1 if cfg.tie_word_embeddings else 2) + cfg.hidden_size * itemsize


def ring_share(budget: Budget, resident: int) -> int | None:
    """The bytes of M the ring plans from (M less the resident parts); None without M."""
    if budget.total is None:
        return None
    return max(0, budget.total - resident)


def check_fits(budget: Budget, resident: int, layers: int, ring: int, tune: int = 0) -> None:
    """Refuse in one line, before anything is read, a plan whose resident parts, ring's layers
    (``layers`` bytes once full, ``ring`` slots) and a tune's least needs (``tune`` bytes:
    ``common.tune_bytes``) exceed M, naming the smallest M."""
    if budget.total is None or resident + layers + tune <= budget.total:
        return
    need = -(-(resident + layers + tune) // MIB)
    where = "--memory" if budget.source == "--memory" else f"memory ({budget.source})"
    fewer = " (or --ring 1)" if ring > 1 else ""
    ring_words = f"a ring of {ring} layers ({layers / MIB:.0f} MiB)"
    if tune:
        fewer += " or a smaller --micro-batch or --seq-len"
        ring_words += (
            f" and a tune's state and least activations ({tune / MIB:.0f} MiB: recomputed)"
        )
    parts = f"({resident / MIB:.0f} MiB: embeddings and head)"
    raise EngineError(
        f"{where} {budget.total / MIB:.0f} MiB cannot hold this model's resident parts "
        f"{parts}{',' if tune else ' and'} {ring_words}; use --memory {need}MiB or more{fewer}, "
        f"with a limit of {need + RUNTIME // MIB} MiB around the process"
    )
