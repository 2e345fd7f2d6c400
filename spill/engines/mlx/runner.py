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
from spill.engines.mlx.model import LOGIT_ROWS, Model, check_params, to_float32
from spill.engines.mlx.ops import log_softmax
from spill.engines.mlx.train import MLXTrainer
from spill.errors import EngineError
from spill.models.lora import LoraConfig


def left_pad(rows: Sequence[np.ndarray], length: int) -> tuple[np.ndarray, np.ndarray]:
    """ids (B, length) int64 and valid (B, length) bool, each row flush right."""
    ids = np.zeros((len(rows), length), dtype=np.int64)
    valid = np.zeros((len(rows), length), dtype=bool)
    for r, row in enumerate(rows):
        n = len(row)
        if n:
            ids[r, length - n :] = np.asarray(row, dtype=np.int64)
            valid[r, length - n :] = True
    return ids, valid


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

    def _check(self, rows: Sequence[np.ndarray], what: str) -> None:
        vocab = self.model.cfg.vocab_size
        for r, row in enumerate(rows):
            row = np.asarray(row)
            if row.ndim != 1 or (len(row) and (row.min() < 0 or row.max() >= vocab)):
                raise EngineError(f"{what} {r}: token ids must be a 1-D array in [0, {vocab})")

    def _sync_stats(self) -> None:
        self.stats.extra["ring_max_live"] = self.model.ring.max_live
        self.stats.extra["ring_wait_seconds"] = self.model.ring.wait_seconds

    def _last_logits(self, h) -> np.ndarray:
        return np.array(self.model.logits(h[:, -1]))  # (B, V) float32

    def generate(
        self, prompts: Sequence[np.ndarray], params: GenerateParams, seeds: Sequence[int]
    ) -> list[Generation]:
        if len(seeds) != len(prompts):
            raise EngineError(f"{len(prompts)} prompts but {len(seeds)} seeds; give one per row")
        self._check(prompts, "prompt")
        if any(len(p) == 0 for p in prompts):
            raise EngineError("an empty prompt cannot be continued; give at least one token")
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise EngineError("sampling needs temperature >= 0 and top_p in (0, 1]")
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
        if len(prompts) != len(completions):
            raise EngineError(f"{len(prompts)} prompts but {len(completions)} completions")
        self._check(prompts, "prompt")
        self._check(completions, "completion")
        if any(len(p) == 0 for p in prompts):
            raise EngineError("scoring needs at least one prompt token before the completion")
        if not prompts:
            return []
        m = self.model
        rows = [
            np.concatenate([np.asarray(p), np.asarray(c)]).astype(np.int64)
            for p, c in zip(prompts, completions, strict=True)
        ]
        width = max(len(r) for r in rows)
        ids, valid = left_pad(rows, width)
        self.stats.prompt_tokens += sum(len(r) for r in rows)
        h = m.forward(mx.array(ids), m.context(mx.array(valid), 0, width), lora=self._adapter)
        # The hidden state at position j predicts token j + 1: keep only completion targets.
        where_r, where_t = [], []
        for r, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            first = width - len(rows[r]) + len(p)  # position of the first completion token
            where_r += [r] * len(c)
            where_t += range(first - 1, first - 1 + len(c))
        rr, tt = np.asarray(where_r, np.int64), np.asarray(where_t, np.int64)
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
        out, at = [], 0
        for c in completions:
            out.append(picked[at : at + len(c)].copy())
            at += len(c)
        return out

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
            self.model = None
