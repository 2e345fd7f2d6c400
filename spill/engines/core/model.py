"""``Model``: a kernel's resident parts (embedding, final norm, head) around a ring of decoder
layers, walked once per forward; the runner generates and scores with it, the trainer trains
through it."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from spill.engines.core.kernel import Array, Kernel
from spill.engines.core.ring import Ring


class Model:
    """A kernel's resident parts around a ring of decoder layers."""

    def __init__(self, kernel: Kernel, ring: Ring):
        self.kernel, self.ring, self.cfg = kernel, ring, kernel.cfg

    def forward(self, ids: Array, ctx, caches: list | None = None, lora: dict | None = None):
        """ids (B, T) -> final-normed hidden states (B, T, hidden), walking every layer.

        ``lora``, when given, maps a layer index to that layer's adapters. Each layer's output
        (and its cache) is computed before the ring moves on: a lazy graph that still referenced
        a released slot would keep its weights alive and run the whole model at the end.
        """
        return self.forward_many([(ids, ctx, caches, lora)])[0]

    def forward_many(self, batches: Sequence[tuple]) -> list:
        """Several ``forward`` batches ``(ids, ctx, caches, lora)`` in one walk over the layers
        (one read of each): a decode step and the prompts joining it (``Runner.serve``)."""
        k = self.kernel
        xs = [k.embed_ids(ids) for ids, *_ in batches]
        for i, w in self.ring.walk(range(self.cfg.num_hidden_layers)):
            for j, (_, ctx, caches, lora) in enumerate(batches):
                cache = caches[i] if caches is not None else None
                xs[j] = k.layer(i, w, xs[j], ctx, cache, lora.get(i) if lora else None)
                k.sync(xs[j], *([cache] if cache is not None else []))
        return [k.final_norm(x) for x in xs]

    def forward_each(self, rows: Sequence[np.ndarray], lora: dict | None = None) -> list:
        """Each row of ids (T_r,) -> its final-normed hidden states (1, T_r, hidden).

        The rows share one walk over the layers (one read of each layer), but every layer runs
        on each row alone at its own length: no padding and no neighbour enters a row's shapes,
        so its numbers do not depend on what it is batched with (padding changes the attention's
        reductions, measured up to 3e-5 in a log-prob on the tiny float32 llama).
        """
        k = self.kernel
        xs = [k.embed_ids(k.array(np.asarray(r, np.int64)[None])) for r in rows]  # (1, T_r, hidden)
        ctxs = [k.context(np.ones((1, len(r)), dtype=bool), 0, len(r)) for r in rows]
        for i, w in self.ring.walk(range(self.cfg.num_hidden_layers)):
            for j, ctx in enumerate(ctxs):
                xs[j] = k.layer(i, w, xs[j], ctx, None, lora.get(i) if lora else None)
                k.sync(xs[j])
        return [k.final_norm(x) for x in xs]

    def close(self) -> None:
        self.ring.close()
        self.kernel.close()
