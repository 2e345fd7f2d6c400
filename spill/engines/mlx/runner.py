"""The MLX Runner: batched generation with a KV cache, and scoring, over the streaming ring.

The torch runner's semantics, step for step: rows are left-padded and positions come from the
mask; generation runs a prefill then one token per step, every step walking all layers. Logits
come back to the host as float32 numpy; greedy is ``argmax`` (first index on ties, as torch), and
a sampled row draws from its own ``numpy.random.Generator`` seeded by ``seeds[r]``, so its draws
never depend on its batch neighbours' (they do differ from torch's generator: sampled text is
reproducible per engine, greedy text agrees across engines).
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from spill.engines.base import EngineInfo, GenerateParams, Generation, Stats
from spill.engines.common import (
    check_generate,
    check_params,
    check_score,
    left_pad,
    score_rows,
    split_scores,
    sync_ring_stats,
)
from spill.engines.mlx.model import LOGIT_ROWS, Model, to_float32
from spill.engines.mlx.ops import log_softmax
from spill.engines.mlx.train import MLXTrainer
from spill.models.lora import LoraConfig


def sample(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """One token from float32 logits (V,): temperature, then the top-p nucleus."""
    z = logits.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    p = probs[order]
    if top_p < 1.0:
        keep = (np.cumsum(p) - p) < top_p
        keep[0] = True  # the most likely token is always in the nucleus
        p = p * keep
    cdf = np.cumsum(p)
    at = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    return int(order[min(at, len(order) - 1)])


class MLXRunner:
    def __init__(self, model: Model, info: EngineInfo, stats: Stats):
        self.model, self.info, self.stats = model, info, stats
        self._adapter: dict[int, dict] | None = None  # layer -> module -> (A, B, scale)

    def use_adapter(self, lora: LoraConfig | None, params: dict[str, np.ndarray] | None) -> None:
        """Later ``generate``/``score`` calls run with this adapter (float32 copies); None: base."""
        if lora is None or params is None:
            self._adapter = None
            return
        check_params(self.model.cfg, lora, params, "adapter")
        self._adapter = self.model.adapters(lora, to_float32(params))

    def trainer(self, lora: LoraConfig) -> MLXTrainer:
        """A trainer on these base weights; the caller sets its state (``init_params`` to start)."""
        return MLXTrainer(self.model, lora)

    def _sync_stats(self) -> None:
        sync_ring_stats(self.stats, self.model.ring)

    def _last_logits(self, h) -> np.ndarray:
        return np.array(self.model.logits(h[:, -1]))  # (B, V) float32

    def generate(
        self, prompts: Sequence[np.ndarray], params: GenerateParams, seeds: Sequence[int]
    ) -> list[Generation]:
        check_generate(prompts, params, seeds, self.model.cfg.vocab_size)
        batch, steps = len(prompts), params.max_new_tokens
        if batch == 0 or steps <= 0:
            return [Generation(np.zeros(0, np.int64), "length") for _ in prompts]
        m = self.model
        width = max(len(p) for p in prompts)
        ids, valid_prompt = left_pad(prompts, width)
        valid = np.zeros((batch, width + steps), dtype=bool)
        valid[:, :width] = valid_prompt
        caches = m.caches(batch, width + steps)
        rngs = [np.random.default_rng(int(s)) for s in seeds]
        stop = set(params.stop_ids)
        out: list[list[int]] = [[] for _ in prompts]
        finish: list[str | None] = [None] * batch
        self.stats.prompt_tokens += sum(len(p) for p in prompts)

        ctx = m.context(mx.array(valid[:, :width]), 0, width)
        logits = self._last_logits(m.forward(mx.array(ids), ctx, caches, self._adapter))
        for step in range(steps):
            nxt = logits.argmax(axis=-1)  # (B,) greedy; sampled rows overwrite theirs
            for r in range(batch):
                if finish[r] is not None:
                    continue  # a finished row draws nothing; its neighbours are unaffected
                if params.temperature > 0:
                    nxt[r] = sample(logits[r], params.temperature, params.top_p, rngs[r])
                tok = int(nxt[r])
                self.stats.generated_tokens += 1
                if tok in stop:
                    finish[r] = "stop"
                else:
                    out[r].append(tok)
            if all(f is not None for f in finish) or step == steps - 1:
                break
            at = width + step
            valid[:, at] = True
            ctx = m.context(mx.array(valid[:, : at + 1]), at, 1)
            h = m.forward(mx.array(nxt[:, None].astype(np.int64)), ctx, caches, self._adapter)
            logits = self._last_logits(h)
        self._sync_stats()
        return [
            Generation(np.asarray(toks, dtype=np.int64), f or "length")
            for toks, f in zip(out, finish, strict=True)
        ]

    def score(
        self, prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray]
    ) -> list[np.ndarray]:
        check_score(prompts, completions, self.model.cfg.vocab_size)
        if not prompts:
            return []
        m = self.model
        rows, width, rr, tt = score_rows(prompts, completions)
        ids, valid = left_pad(rows, width)
        self.stats.prompt_tokens += sum(len(r) for r in rows)
        h = m.forward(mx.array(ids), m.context(mx.array(valid), 0, width), lora=self._adapter)
        picked = np.zeros(len(rr), np.float32)
        if len(rr):
            hs = h[mx.array(rr), mx.array(tt)]  # (N, hidden)
            targets = mx.array(ids[rr, tt + 1])  # (N,)
            for j in range(0, len(rr), LOGIT_ROWS):  # never (N, vocab) at once
                logits = m.logits(hs[j : j + LOGIT_ROWS])  # float32
                logp = log_softmax(logits)
                got = mx.take_along_axis(logp, targets[j : j + LOGIT_ROWS, None], axis=1)[:, 0]
                picked[j : j + LOGIT_ROWS] = np.array(got)
        self._sync_stats()
        return split_scores(picked, completions)

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
            self.model = None
