"""The kernel: what one engine must supply for spill's core to run a model on it (``Kernel``).

The core (``spill.engines.core``) owns the ring, the KV-cached generate/score bookkeeping and the
streamed training walk; it never imports torch or mlx. A kernel owns one model's resident parts
(embeddings, final norm, lm_head, rotary table) and a handful of primitives over its own arrays,
which the core treats as opaque except for basic slicing (``h[:, -1]``, ``x[j:k]``) and indexing by
two of the kernel's integer arrays (``h[rows, cols]``), read alike by torch and MLX. A third engine
is a kernel plus its model families, never a copy of the core.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from spill.engines.base import AdamW, Objective
from spill.models.config import FAMILIES, ModelConfig
from spill.models.family_keys import EXPERT_LINEARS, EXPERTS

Array = Any  # an engine's array (torch.Tensor, mx.array)
# A layer's adapters by module name (``self_attn.q_proj``): (A (in, r), B (r, out), scale) and,
# while training with dropout, the dropout applied to the adapter's float32 input.
LayerLora = dict[str, tuple]


@dataclass(frozen=True)
class RowAdapters:
    """One linear's adapters when a batch's rows carry different ones (``Runner.serve``):
    ``parts`` pairs the batch rows (a kernel array of indices) with their adapter tuple; a row
    in no part runs the base linear. Never in training."""

    parts: tuple[tuple[Any, tuple], ...]
    batch: tuple[np.ndarray, ...] = ()  # each part's batch rows as numpy (int64)

    def gathered(self, tokens: np.ndarray, length: int, array: Callable) -> RowAdapters:
        """These adapters for rows gathered by token (an expert's: ``tokens`` index the flat
        (B * length) tokens): each part's rows become the positions of its rows' tokens,
        ``array`` making the kernel's index array; a part with none is left out."""
        parts = []
        for rows, (_, adapter) in zip(self.batch, self.parts, strict=True):
            at = np.flatnonzero(np.isin(tokens // length, rows))
            if len(at):
                parts.append((array(at), adapter))
        return RowAdapters(tuple(parts))


def expert_lora(lora, e: int, tokens: Callable[[], np.ndarray], length: int, array: Callable):
    """``lora`` with expert ``e``'s per-row adapters (``RowAdapters``: rows of a batch on
    different adapters) indexed by the tokens gathered for it: ``tokens()``, asked for only
    then, are its rows of the flat (B * length) tokens; ``array`` makes the kernel's index."""
    names = [f"{EXPERTS}{e}.{p}" for p in EXPERT_LINEARS]
    mixed = {n: lora[n] for n in names if lora and isinstance(lora.get(n), RowAdapters)}
    if not mixed:
        return lora
    at = tokens()
    return lora | {n: r.gathered(at, length, array) for n, r in mixed.items()}


Sampler = Callable[[np.ndarray, float, float], int]  # (float32 logits (V,), temperature, top_p)
# lm_head runs on chunks of this many rows, never (N, vocab) at once: each float32 temporary of a
# chunk (logits, log-softmax, their gradient) is 12.6 MB at SmolLM2's 49152 tokens. Was 1024
# rows, then 256: a 4 x 128 micro-batch's head took ~175 MB of anonymous memory at its peak,
# more than --memory 300MB leaves for activations; at 64 ~45 MB, for ~1.6% of a step's time
# (the head's walk 1.0 s -> 1.4 s of a ~25 s step, SmolLM2 on 2 cores). Every walk chunks
# alike, so the exactness between walks holds whatever the BLAS does per chunk.
LOGIT_ROWS = 64


def family_modules(engine: str) -> dict[str, ModuleType]:
    """Every family ``spill.models`` knows -> its math in the engine's package: the module named
    after the family (``spill.engines.torch.qwen3``). A new family is that file per engine and its
    metadata, never a line here or in a kernel."""
    return {name: importlib.import_module(f"{engine}.{name}") for name in FAMILIES}


class Kernel(Protocol):
    cfg: ModelConfig
    itemsize: int  # bytes per element of the base weights' compute dtype

    # -- arrays in and out ---------------------------------------------------------------------
    def array(self, a: np.ndarray) -> Array:
        """A numpy array (token ids, positions) as the engine's array, on its device."""
        ...

    def params(self, arrays: dict[str, np.ndarray]) -> dict[str, Array]:
        """Own float32 copies on the device (never sharing memory with the caller's arrays)."""
        ...

    def numpy(self, x: Array) -> np.ndarray:
        """A host copy of ``x``, in its own dtype."""
        ...

    def zeros_like(self, x: Array) -> Array: ...

    def sync(self, *xs: Any) -> None:
        """Make ``xs`` (arrays, KV caches) computed now; a lazy engine must, before the ring
        releases the weights they were computed from."""
        ...

    def inference(self) -> AbstractContextManager:
        """A context in which no gradients are recorded (generation, scoring)."""
        ...

    # -- the model ---------------------------------------------------------------------------
    def context(self, valid: np.ndarray, start: int, length: int) -> Any:
        """What every layer of one forward shares, for ``length`` tokens at ``start`` given the
        valid keys (B, start + length) bool."""
        ...

    def caches(self, batch: int, length: int) -> list:
        """One KV cache per layer, preallocated for ``length`` positions."""
        ...

    def keep_rows(self, caches: list, rows: np.ndarray) -> None:
        """Keep only batch rows ``rows`` (ascending) of every cache, in place."""
        ...

    def rebuild(self, parts: Sequence[tuple[list, np.ndarray, int, int]], length: int) -> list:
        """New caches of ``length`` positions holding, part after part, the rows of each part
        ``(caches, rows, lo, at)``: positions ``lo:`` of those rows land from position ``at``
        (as many as fit). Joins batches, drops rows, shifts and trims positions at once."""
        ...

    def embed_ids(self, ids: Array) -> Array:
        """ids (B, T) -> (B, T, hidden)."""
        ...

    def layer(
        self,
        i: int,
        w: dict,
        x: Array,
        ctx: Any,
        cache: Any,
        lora: LayerLora | None,
        outputs: dict | None = None,
    ) -> Array:
        """Decoder layer ``i`` (its weights ``w``): x (B, T, hidden) -> (B, T, hidden); the index
        says what differs by layer (no rotary, a sliding window). Given ``outputs`` (empty), the
        base outputs of the ``kept_outputs`` linears are stored in it for ``layer_vjp``."""
        ...

    def final_norm(self, x: Array) -> Array: ...

    def logits(self, h: Array) -> Array:
        """h (N, hidden) -> float32 logits (N, V)."""
        ...

    def log_probs(self, h: Array, targets: Array) -> np.ndarray:
        """float32 log-prob of ``targets`` (N,) under the logits of h (N, hidden)."""
        ...

    def sampler(self, seed: int) -> Sampler:
        """A token sampler whose draws come from ``seed`` alone."""
        ...

    # -- training ------------------------------------------------------------------------------
    def dropout(self, p: float, seed: int) -> Callable[[Array], Array]:
        """Inverted dropout with probability ``p`` whose mask comes from ``seed`` alone."""
        ...

    def layer_vjp(
        self,
        i: int,
        w: dict,
        x: Array,
        ctx: Any,
        leaves: Sequence[Array],
        lora: Callable[[Sequence[Array]], LayerLora],
        grad: Array,
        wrt_input: bool,
        outputs: dict | None = None,
    ) -> tuple[Array | None, list[Array]]:
        """Recompute ``layer(i, w, x, ctx, None, lora(leaves))`` and pull ``grad`` back through it:
        (gradient at x, or None without ``wrt_input``; the gradient of each leaf). ``outputs``:
        what the forward's ``layer`` kept; those linears are not computed again."""
        ...

    def stack_vjp(
        self,
        ws: Sequence[dict],
        x: Array,
        ctx: Any,
        leaves: Sequence[Sequence[Array]],
        loras: Sequence[Callable[[Sequence[Array]], LayerLora]],
        tokens: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
        scale: float,
        objective: Objective | None = None,
    ) -> tuple[float, list[list[Array]]]:
        """Every layer of ``ws`` in order from x (``ws[i]`` is layer ``i``, with
        ``loras[i](leaves[i])``), then
        ``head_vjp``'s loss, keeping what backward needs, and backward once through all of it:
        (the head's loss, each layer's leaf gradients). The same ops in the same order as
        ``layer`` forward, ``head_vjp``, then ``layer_vjp`` down the layers, so the same bits."""
        ...

    def memory_budget(self) -> int:
        """Bytes a step's kept activations may take on this device now."""
        ...

    def kept_outputs(self) -> frozenset[str]:
        """Linears (``mlp.gate_proj``) whose base outputs ``layer`` can keep for ``layer_vjp``
        (empty: the recompute computes every linear again)."""
        ...

    def head_vjp(
        self,
        x: Array,
        tokens: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
        scale: float,
        objective: Objective | None = None,
    ) -> tuple[float, Array]:
        """Cross-entropy summed over the targets (the hidden state at (rows, cols) predicts
        ``tokens[rows, cols + 1]``) times ``scale``, and its gradient at the last layer's
        output x, through the final norm and lm_head. With ``objective`` the loss is its loss
        of the targets' cross-entropies instead (``scale`` unused)."""
        ...

    def target_ces(
        self, x: Array, tokens: np.ndarray, rows: np.ndarray, cols: np.ndarray
    ) -> np.ndarray:
        """Each target's cross-entropy (float32, (N,)) from the last layer's output x, with the
        very ops ``head_vjp`` computes it with under an objective."""
        ...

    def adamw(
        self,
        opt: AdamW,
        names: Sequence[str],
        params: dict[str, Array],
        m: dict[str, Array],
        v: dict[str, Array],
        grads: dict[str, Array],
    ) -> None:
        """One AdamW update of ``params``, ``m`` and ``v`` from ``grads``, in place (entries may
        be replaced by new arrays); every gradient is zero afterwards."""
        ...

    def close(self) -> None: ...
