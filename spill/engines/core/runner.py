"""``StreamRunner``, the ``base.Runner`` of every engine: KV-cached generation (``generate``,
and ``serve``'s continuous batching: ``core.decode``) and scoring.

Greedy is ``argmax`` (the first index on ties); a sampled row draws from its own sampler seeded
by its seed, so its draws never depend on its neighbours'. Scoring computes each row alone at
its own length in one shared walk, so a row's log-probs are the same bits in any batch;
generation pads the batch (its logits move with the padding within ~1e-5 in float32, so a
greedy token changes only where two candidates tie that closely).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from spill.engines.base import (
    BatchPlan,
    EngineInfo,
    GenerateParams,
    Generation,
    OnToken,
    Request,
    Stats,
    Take,
    Token,
)
from spill.engines.core import decode, heap
from spill.engines.core.batching import ROWS_FRACTION, plan_batch
from spill.engines.core.common import (
    check_generate,
    check_params,
    check_score,
    sync_ring_stats,
)
from spill.engines.core.kernel import LOGIT_ROWS
from spill.engines.core.model import Model
from spill.engines.core.train import StreamTrainer, layer_adapters
from spill.errors import EngineError
from spill.models.lora import LoraConfig


def sample_numpy(logits: np.ndarray, temperature: float, top_p: float, rng) -> int:
    """One token from float32 logits (V,): temperature, then the top-p nucleus, drawn with a
    ``numpy.random.Generator`` (for a kernel without a generator of its own)."""
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


def host_free() -> int:
    """Bytes of host memory available now (a CPU's, or a unified-memory GPU's)."""
    import psutil

    return int(psutil.virtual_memory().available)


class StreamRunner:
    def __init__(
        self,
        model: Model,
        info: EngineInfo,
        stats: Stats,
        memory: int | None = None,
        layer_memory: int | None = None,
    ):
        self.model, self.info, self.stats = model, info, stats
        # what a budget (``--memory``, a cgroup's limit) leaves past the resident parts, for
        # the layers, activations and the batch (``core.budget``); None: the device decides
        self.memory = memory
        # bytes the ring's layers take once full (``RingPlan.layer_memory``: packed slots and
        # the expanded layer in use); None: ``ring`` layers in the compute dtype
        if layer_memory is None:
            layer_memory = info.ring * model.cfg.layer_params() * model.kernel.itemsize
        self.layer_memory = layer_memory
        self._adapter: dict[int, dict] | None = None  # layer -> module -> (A, B, scale)
        self._named: dict[str, dict[int, dict]] = {}  # ``serve``'s adapters by name
        # Free device memory in bytes now; None: the host's (``host_free``), right for a CPU
        # and MLX's unified memory. A discrete GPU's opener sets it, or its batch stays fixed.
        self.free_memory: Callable[[], int] | None = None

    def plan_batch(self, tokens: int, rows: int) -> BatchPlan:
        """The batch a row job of ``rows`` rows of at most ``tokens`` tokens runs at
        (``spill.engines.core.batching``): the rows share each walk over the layers."""
        info, cfg = self.info, self.model.cfg
        itemsize = 4 if info.numerics == "float32" else 2
        free = None
        if self.free_memory is not None:
            free = self.free_memory()
        elif not info.device.startswith("cuda"):
            free = host_free()
        if free is not None:
            if not info.resident:  # the ring's slots fill on its first walk: count them taken
                free = max(0, free - self.layer_memory)
            free = int(free * ROWS_FRACTION)  # resident layers were loaded at open
        if self.memory is not None:  # the budget's share past the layers, wherever it is
            left = int(max(0, self.memory - self.layer_memory) * ROWS_FRACTION)
            free = left if free is None else min(free, left)
        return plan_batch(cfg, itemsize, tokens, rows, free)

    def use_adapter(self, lora: LoraConfig | None, params: dict[str, np.ndarray] | None) -> None:
        """Later ``generate``/``score`` calls run with this adapter (float32 copies); None: base."""
        if lora is None or params is None:
            self._adapter = None
            return
        cfg = self.model.cfg
        check_params(cfg, lora, params, "adapter")
        arrays = self.model.kernel.params(params)
        self._adapter = {
            i: layer_adapters(cfg, lora, i, arrays) for i in range(cfg.num_hidden_layers)
        }

    def trainer(self, lora: LoraConfig) -> StreamTrainer:
        """A trainer on these base weights; the caller sets its state (``init_params`` to start)."""
        return StreamTrainer(self.model, lora, self.activation_budget)

    def activation_budget(self, held: int = 0) -> int:
        """Bytes a training step's activations may take now: the kernel's budget (half the
        memory available), and within an explicit ``--memory`` what the ring's layers and the
        trainer's ``held`` state (adapters, moments, gradients) leave."""
        budget = self.model.kernel.memory_budget()
        if self.memory is not None:
            budget = min(budget, max(0, self.memory - self.layer_memory - held))
        return budget

    def add_adapter(self, name: str, lora: LoraConfig, params: dict[str, np.ndarray]) -> None:
        """An adapter that ``serve``'s requests name; its float32 copies stay for the runner's
        life."""
        cfg = self.model.cfg
        check_params(cfg, lora, params, f"adapter {name}")
        arrays = self.model.kernel.params(params)
        self._named[name] = {
            i: layer_adapters(cfg, lora, i, arrays) for i in range(cfg.num_hidden_layers)
        }

    def generate(
        self,
        prompts: Sequence[np.ndarray],
        params: GenerateParams,
        seeds: Sequence[int],
        on_token: OnToken | None = None,
    ) -> list[Generation]:
        check_generate(prompts, params, seeds, self.model.cfg.vocab_size)
        if len(prompts) == 0 or params.max_new_tokens <= 0:
            return [Generation(np.zeros(0, np.int64), "length") for _ in prompts]
        done: list[Generation] = [Generation(np.zeros(0, np.int64), "length")] * len(prompts)

        def request(r: int, prompt: np.ndarray, seed: int) -> Request:
            def seen(t: Token) -> bool | None:
                return on_token(r, t.id) if on_token is not None else None

            def end(g: Generation) -> None:
                done[r] = g

            return Request(
                np.asarray(prompt, np.int64), params, int(seed), on_token=seen, on_done=end
            )

        pending = [[request(r, p, s) for r, (p, s) in enumerate(zip(prompts, seeds, strict=True))]]
        self._loop(lambda idle: pending.pop() if pending else None, lambda req: self._adapter)
        return done

    def serve(self, take: Take) -> None:
        def adapter(req: Request) -> dict | None:
            if req.adapter is None:
                return None
            if req.adapter not in self._named:
                raise EngineError(f"no adapter named {req.adapter!r}; add it first (add_adapter)")
            return self._named[req.adapter]

        self._loop(take, adapter)

    def _loop(self, take: Take, adapter: Callable[[Request], dict | None]) -> None:
        """The one generation loop: admit what ``take`` gives, walk the layers once per step
        for the running rows and the joining prompts, choose each row's token."""
        m = self.model
        batch, more = None, True
        with m.kernel.inference():
            while True:
                joining: list[decode.Row] = []
                if more:
                    got = take(batch is None)
                    more = got is not None
                    joining = self._admit(got or (), adapter)
                if batch is None:
                    if not joining:
                        if more:
                            continue
                        break
                    batch, logits = decode.start(m, joining)
                else:
                    logits = decode.step(m, batch, joining)
                decode.choose(batch, logits, self.stats)
                batch = decode.shrink(m, batch)
        sync_ring_stats(self.stats, m.ring)

    def _admit(self, reqs: Sequence[Request], adapter) -> list[decode.Row]:
        """Rows for ``reqs``, checked; an ``echo`` request's prompt is scored first (one walk
        for all of them), and a request for no new tokens ends there."""
        k, vocab = self.model.kernel, self.model.cfg.vocab_size
        rows = []
        for req in reqs:
            check_generate([req.prompt], req.params, [req.seed], vocab)
            if req.logprobs is not None and req.logprobs < 0:
                raise EngineError(f"logprobs must be 0 or more, not {req.logprobs}")
            rows.append(decode.Row(req, adapter(req), k.sampler(int(req.seed))))
        echoed = [r for r in rows if r.req.echo]
        for r, tokens in zip(echoed, self._prompt_tokens(echoed), strict=True):
            if r.req.on_prompt is not None:
                r.req.on_prompt(tokens)
        for r in rows:
            if r.req.params.max_new_tokens <= 0:
                r.end("length")
        return [r for r in rows if r.finish is None]

    def _prompt_tokens(self, rows: list[decode.Row]) -> list[list[Token]]:
        """Each row's prompt tokens with their log-probs given the tokens before (the first has
        none): the same bits as ``score``, and the row's ``logprobs`` likeliest beside each."""
        if not rows:
            return []
        m, k = self.model, self.model.kernel
        hidden: dict[int, object] = {}  # row index -> its hidden states: one walk per adapter
        for lora in {id(r.lora): r.lora for r in rows}.values():
            mine = [j for j, r in enumerate(rows) if r.lora is lora]
            walked = m.forward_each([rows[j].req.prompt for j in mine], lora)
            hidden.update(zip(mine, walked, strict=True))
        out = []
        for j, r in enumerate(rows):
            ids, top, h = r.req.prompt, r.req.logprobs or 0, hidden[j]
            tokens = [Token(int(ids[0]))]
            targets = k.array(ids[1:])
            for j in range(0, len(ids) - 1, LOGIT_ROWS):
                end = min(j + LOGIT_ROWS, len(ids) - 1)
                got = k.log_probs(h[0, j:end], targets[j:end])
                lp = decode.log_softmax(k.numpy(k.logits(h[0, j:end]))) if top else None
                for t in range(end - j):
                    tok, own = int(ids[j + t + 1]), float(got[t])
                    # the token among the likeliest carries its own (score's) bits, so a
                    # client comparing it with the largest sees them equal when it is greedy
                    near = decode.likeliest(lp[t], top) if top else ()
                    near = tuple((i, own if i == tok else v) for i, v in near)
                    tokens.append(Token(tok, own, near))
            out.append(tokens)
        return out

    def score(
        self, prompts: Sequence[np.ndarray], completions: Sequence[np.ndarray]
    ) -> list[np.ndarray]:
        check_score(prompts, completions, self.model.cfg.vocab_size)
        m, k = self.model, self.model.kernel
        pairs = zip(prompts, completions, strict=True)
        rows = [np.concatenate([np.asarray(p), np.asarray(c)]).astype(np.int64) for p, c in pairs]
        out = []
        with k.inference():
            hs = m.forward_each(rows, self._adapter) if rows else []
            for p, c, row, h in zip(prompts, completions, rows, hs, strict=True):
                got = np.zeros(len(c), np.float32)
                first = len(p) - 1  # the hidden state at position j predicts token j + 1
                targets = k.array(row[len(p) :])  # (len(c),)
                for j in range(0, len(c), LOGIT_ROWS):  # never (len(c), vocab) at once
                    end = min(j + LOGIT_ROWS, len(c))
                    got[j:end] = k.log_probs(h[0, first + j : first + end], targets[j:end])
                out.append(got)
        sync_ring_stats(self.stats, m.ring)
        return out

    def close(self) -> None:
        if self.model is not None:
            self.model.close()
            self.model = None
            if self.memory is not None:  # under a budget the next job of this process has it
                heap.trim()
