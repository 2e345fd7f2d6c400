"""The torch Runner: batched generation with a KV cache, and scoring, over the streaming ring.

Rows are left-padded; positions come from the mask, so padding shifts nothing. Generation runs a
prefill, then one token per step, and every step walks all layers (in streaming mode each step
streams the whole model: that is the design). Sampling happens on the CPU in float32 with one
``torch.Generator`` per row seeded by ``seeds[r]``: a row's draws never depend on its batch
neighbours', nor on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

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
from spill.engines.torch.model import LOGIT_ROWS, Model, to_float32
from spill.engines.torch.train import TorchTrainer
from spill.models.lora import LoraConfig


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """One token from float32 logits (V,): temperature, then the top-p nucleus."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return int(torch.multinomial(probs, 1, generator=gen))
    p, order = probs.sort(descending=True, stable=True)
    keep = (p.cumsum(0) - p) < top_p
    keep[0] = True  # the most likely token is always in the nucleus
    return int(order[torch.multinomial(p * keep, 1, generator=gen)])


class TorchRunner:
    def __init__(self, model: Model, info: EngineInfo, stats: Stats):
        self.model, self.info, self.stats = model, info, stats
        self._adapter: dict[int, dict] | None = None  # layer -> module -> (A, B, scale)

    def use_adapter(self, lora: LoraConfig | None, params: dict[str, np.ndarray] | None) -> None:
        """Later ``generate``/``score`` calls run with this adapter (float32 copies); None: base."""
        if lora is None or params is None:
            self._adapter = None
            return
        check_params(self.model.cfg, lora, params, "adapter")
        self._adapter = self.model.adapters(lora, to_float32(params, self.model.device))

    def trainer(self, lora: LoraConfig) -> TorchTrainer:
        """A trainer on these base weights; the caller sets its state (``init_params`` to start)."""
        return TorchTrainer(self.model, lora)

    def _sync_stats(self) -> None:
        sync_ring_stats(self.stats, self.model.ring)

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[np.ndarray], params: GenerateParams, seeds: Sequence[int]
    ) -> list[Generation]:
        check_generate(prompts, params, seeds, self.model.cfg.vocab_size)
        batch, steps = len(prompts), params.max_new_tokens
        if batch == 0 or steps <= 0:
            return [Generation(np.zeros(0, np.int64), "length") for _ in prompts]
        m, dev = self.model, self.model.device
        width = max(len(p) for p in prompts)
        ids, valid_prompt = (torch.from_numpy(a).to(dev) for a in left_pad(prompts, width))
        valid = torch.zeros(batch, width + steps, dtype=torch.bool, device=dev)
        valid[:, :width] = valid_prompt
        caches = m.caches(batch, width + steps)
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        stop = set(params.stop_ids)
        out: list[list[int]] = [[] for _ in prompts]
        finish: list[str | None] = [None] * batch
        self.stats.prompt_tokens += sum(len(p) for p in prompts)

        ctx = m.context(valid[:, :width], 0, width)
        h = m.forward(ids, ctx, caches, self._adapter)  # (B, T, hidden)
        logits = m.logits(h[:, -1]).cpu()  # (B, V)
        for step in range(steps):
            nxt = logits.argmax(dim=-1)  # (B,) greedy; sampled rows overwrite theirs
            for r in range(batch):
                if finish[r] is not None:
                    continue  # a finished row draws nothing; its neighbours are unaffected
                if params.temperature > 0:
                    nxt[r] = sample(logits[r], params.temperature, params.top_p, gens[r])
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
            ctx = m.context(valid[:, : at + 1], at, 1)
            h = m.forward(nxt[:, None].to(dev), ctx, caches, self._adapter)
            logits = m.logits(h[:, -1]).cpu()
        self._sync_stats()
        return [
            Generation(np.asarray(toks, dtype=np.int64), f or "length")
            for toks, f in zip(out, finish, strict=True)
        ]

    @torch.inference_mode()
    def score(
        self, prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray]
    ) -> list[np.ndarray]:
        check_score(prompts, completions, self.model.cfg.vocab_size)
        if not prompts:
            return []
        m, dev = self.model, self.model.device
        rows, width, rr, tt = score_rows(prompts, completions)
        ids, valid = (torch.from_numpy(a).to(dev) for a in left_pad(rows, width))
        self.stats.prompt_tokens += sum(len(r) for r in rows)
        h = m.forward(ids, m.context(valid, 0, width), lora=self._adapter)  # (B, T, hidden)
        rr, tt = torch.from_numpy(rr).to(dev), torch.from_numpy(tt).to(dev)
        hs, targets = h[rr, tt], ids[rr, tt + 1]  # (N, hidden), (N,)
        picked = np.zeros(len(targets), np.float32)
        for j in range(0, len(targets), LOGIT_ROWS):  # never (N, vocab) at once
            logp = torch.log_softmax(m.logits(hs[j : j + LOGIT_ROWS]), dim=-1)  # float32
            got = logp.gather(1, targets[j : j + LOGIT_ROWS, None])[:, 0]
            picked[j : j + LOGIT_ROWS] = got.cpu().numpy()
        self._sync_stats()
        return split_scores(picked, completions)

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
            self.model = None
