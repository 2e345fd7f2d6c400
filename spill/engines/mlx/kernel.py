"""The MLX kernel (``MLXKernel``): one model's resident parts and the primitives
``spill.engines.core`` runs, with the torch kernel's semantics, op for op where the engines must
agree. MLX is lazy: ``sync`` evaluates, and the core syncs after every layer, so a released ring
slot is really free. A sampled row draws from its own ``numpy.random.Generator``
(``core.runner.sample_numpy``): its draws differ from torch's generator, so sampled text is
reproducible per engine, greedy text agrees across engines. ``adamw`` is torch.optim.AdamW's
single-tensor update on a CPU, op for op and bit for bit in m and v; the step is passed in.
"""

from __future__ import annotations

from contextlib import nullcontext
from types import ModuleType

import mlx.core as mx
import numpy as np

from spill.engines.base import AdamW, Objective
from spill.engines.core.common import adamw_factors, long_rope
from spill.engines.core.kernel import LOGIT_ROWS, family_modules
from spill.engines.core.runner import sample_numpy
from spill.engines.mlx.ops import (
    Context,
    KVCache,
    context,
    embedding,
    inv_freq,
    log_softmax,
    matmul_t,
    rms_norm,
)
from spill.engines.mlx.reader import WeightReader, arrays, default_budget
from spill.models.config import ModelConfig

FAMILIES: dict[str, ModuleType] = family_modules("spill.engines.mlx")


# LoRA dropout masks key ``mx.random`` with the module's seed.
def dropout(p: float, seed: int):
    """Inverted dropout with probability ``p`` whose mask comes from ``seed`` alone."""

    def drop(h):  # h (B, T, in) float32
        keep = mx.random.uniform(shape=h.shape, key=mx.random.key(seed)) >= p  # (B, T, in)
        return h * keep * (1.0 / (1.0 - p))

    return drop


# torch's ``lerp_`` and ``addcmul_`` kernels round a fused multiply-add once, which ``fma``
# reproduces through float64; ``adamw``'s bias corrections are Python floats.
def fma(a, b, c):
    """``a * b + c`` rounded once, as torch's CPU kernels for ``lerp_`` and ``addcmul_`` compute
    it (a float32 product is exact in float64; the sum rounds to float32 as a fused op would)."""
    f64 = mx.float64
    return (a.astype(f64) * b.astype(f64) + c.astype(f64)).astype(mx.float32)


class MLXKernel:
    def __init__(self, cfg: ModelConfig, reader: WeightReader):
        self.cfg, self.reader = cfg, reader
        self.family = FAMILIES[cfg.family]
        self.dtype = reader.dtype
        self.itemsize = self.dtype.size
        self.embed = reader.tensor("model.embed_tokens.weight")  # (V, hidden)
        self.norm = reader.tensor("model.norm.weight")
        tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
        self.lm_head = self.embed if tied else reader.tensor("lm_head.weight")
        self.freq = inv_freq(cfg)
        self.long_freq = inv_freq(cfg, long=True) if cfg.rope_long else None
        local = cfg.local_rope_theta
        self.local_freq = None if local is None else inv_freq(cfg, local)
        # Gemma's sqrt(hidden) as transformers multiplies it: a float32 scalar in the model's dtype
        self.embed_scale = mx.array(cfg.embed_scale, dtype=mx.float32).astype(self.dtype)
        head = {"embed": self.embed, "norm": self.norm, "lm_head": self.lm_head}
        mx.eval(arrays(head), self.freq)  # a packed embedding or head is three arrays

    # -- arrays in and out ---------------------------------------------------------------------
    def array(self, a: np.ndarray) -> mx.array:
        return mx.array(a)

    def params(self, arrays: dict[str, np.ndarray]) -> dict[str, mx.array]:
        return {n: mx.array(np.asarray(a, dtype=np.float32)) for n, a in arrays.items()}

    def numpy(self, x: mx.array) -> np.ndarray:
        return np.array(x, copy=True)

    def zeros_like(self, x: mx.array) -> mx.array:
        return mx.zeros_like(x)

    def sync(self, *xs) -> None:
        mx.eval(*(x.arrays() if isinstance(x, KVCache) else x for x in xs))

    def inference(self):
        return nullcontext()  # MLX records no graph; gradients exist only inside mx.vjp

    # -- the model ---------------------------------------------------------------------------
    def context(self, valid: np.ndarray, start: int, length: int) -> Context:
        window = self.cfg.sliding_window if self.cfg.windowed else None
        freq = self.long_freq if long_rope(self.cfg, valid, start, length) else self.freq
        scale = self.cfg.rope_attention
        ctx = context(
            mx.array(valid), start, length, freq, self.dtype, window, self.local_freq, scale
        )
        tables = (ctx.cos, ctx.sin, ctx.mask, ctx.window, *(ctx.local or ()))
        mx.eval([a for a in tables if a is not None])
        return ctx

    def caches(self, batch: int, length: int) -> list[KVCache]:
        c = self.cfg
        return [
            KVCache(batch, c.num_key_value_heads, length, c.head_dim, self.dtype)
            for _ in range(c.num_hidden_layers)
        ]

    def keep_rows(self, caches: list[KVCache], rows: np.ndarray) -> None:
        idx = mx.array(rows)
        for c in caches:
            c.k, c.v = c.k[idx], c.v[idx]  # (B', KV, L, D)
        mx.eval([a for c in caches for a in (c.k, c.v)])

    def rebuild(self, parts, length: int) -> list[KVCache]:
        out = self.caches(sum(len(rows) for _, rows, _, _ in parts), length)
        for i, new in enumerate(out):
            first = 0
            for caches, rows, lo, at in parts:
                old, idx = caches[i], mx.array(rows)
                n = min(old.k.shape[2] - lo, length - at)
                span = slice(first, first + len(rows))
                new.k[span, :, at : at + n] = old.k[idx, :, lo : lo + n]
                new.v[span, :, at : at + n] = old.v[idx, :, lo : lo + n]
                first += len(rows)
        mx.eval([a for c in out for a in (c.k, c.v)])
        return out

    def embed_ids(self, ids):
        x = embedding(self.embed, ids)  # (B, T, hidden)
        return x if self.cfg.embed_scale == 1.0 else x * self.embed_scale

    def layer(self, i: int, w: dict, x, ctx: Context, cache=None, lora=None, outputs=None):
        # keeps no base outputs (``kept_outputs`` is empty): mx.vjp recomputes the whole layer
        return self.family.layer(self.cfg, i, w, x, ctx, cache, lora)

    def final_norm(self, x):
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps, self.cfg.norm_offset)

    def logits(self, h):
        """h (N, hidden) -> float32 logits (N, V)."""
        return matmul_t(h, self.lm_head).astype(mx.float32)  # a tied packed head stays packed

    def log_probs(self, h, targets) -> np.ndarray:
        logp = log_softmax(self.logits(h))  # (N, V) float32
        return np.array(mx.take_along_axis(logp, targets[:, None], axis=1)[:, 0])

    def sampler(self, seed: int):
        rng = np.random.default_rng(seed)

        def draw(logits: np.ndarray, temperature: float, top_p: float) -> int:
            return sample_numpy(logits, temperature, top_p, rng)

        return draw

    # -- training ------------------------------------------------------------------------------
    def dropout(self, p: float, seed: int):
        return dropout(p, seed)

    # Gradients come from ``mx.vjp`` one layer at a time (the recompute walk), or, with kept
    # activations, from one ``mx.vjp`` over the whole resident stack and the head (``stack_vjp``).
    def layer_vjp(self, i, w, x, ctx, leaves, lora, grad, wrt_input: bool, outputs=None):
        def step(h, *lv):
            return [self.layer(i, w, h, ctx, None, lora(list(lv)))]

        if wrt_input:
            _, got = mx.vjp(step, [x, *leaves], [grad])
            return got[0], list(got[1:])
        _, got = mx.vjp(lambda *lv: step(x, *lv), list(leaves), [grad])
        return None, list(got)

    # ``head_vjp``'s ops inside, the chunk losses summed from zero with ``scale`` as the cotangent,
    # so the same bits as the recompute walk; MLX keeps no graph between calls, so the head must be
    # inside.
    def stack_vjp(self, ws, x, ctx, leaves, loras, tokens, rows, cols, scale, objective=None):
        sizes = [len(group) for group in leaves]
        r, c = mx.array(rows), mx.array(cols)
        labels = mx.array(tokens[rows, cols + 1])  # (N,): position t predicts t + 1
        if objective is not None:
            return self._objective_stack(ws, x, ctx, leaves, loras, labels, r, c, objective)

        def run(*flat):  # head_vjp's ops: chunked cross-entropy, the sum from zero
            h, at = x, 0
            for i, (w, n, lora) in enumerate(zip(ws, sizes, loras, strict=True)):
                h = self.layer(i, w, h, ctx, None, lora(list(flat[at : at + n])))
                at += n
            picked = self.final_norm(h)[r, c]  # (N, hidden)
            total = mx.zeros((), dtype=mx.float32)
            for j in range(0, len(rows), LOGIT_ROWS):
                logp = log_softmax(self.logits(picked[j : j + LOGIT_ROWS]))  # float32 (n, V)
                y = labels[j : j + LOGIT_ROWS]
                total = total + -mx.sum(mx.take_along_axis(logp, y[:, None], axis=1))
            return [total]

        flat = [a for group in leaves for a in group]
        (total,), got = mx.vjp(run, flat, [mx.array(scale, mx.float32)])
        total = total * scale
        mx.eval(total, got)
        out, at = [], 0
        for n in sizes:
            out.append(list(got[at : at + n]))
            at += n
        return float(total.item()), out

    # mx.vjp takes its cotangents up front, and an objective's weights need every target's
    # cross-entropy first: the stack runs forward once for them, then once more inside the vjp.
    def _objective_stack(self, ws, x, ctx, leaves, loras, labels, r, c, objective: Objective):
        sizes = [len(group) for group in leaves]

        def run(*flat):  # every target's cross-entropy, in order
            h, at = x, 0
            for i, (w, n, lora) in enumerate(zip(ws, sizes, loras, strict=True)):
                h = self.layer(i, w, h, ctx, None, lora(list(flat[at : at + n])))
                at += n
            picked = self.final_norm(h)[r, c]
            return [self._ces(picked, labels)]

        flat = [a for group in leaves for a in group]
        (ce,) = run(*flat)
        mx.eval(ce)
        loss, weights = objective(np.array(ce), np.array(r), np.array(c))
        _, got = mx.vjp(run, flat, [mx.array(np.asarray(weights, np.float32))])
        mx.eval(got)
        out, at = [], 0
        for n in sizes:
            out.append(list(got[at : at + n]))
            at += n
        return float(loss), out

    def target_ces(self, x, tokens, rows, cols) -> np.ndarray:
        labels = mx.array(tokens[rows, cols + 1])
        ce = self._ces(self.final_norm(x)[mx.array(rows), mx.array(cols)], labels)
        mx.eval(ce)
        return np.array(ce)

    def _ces(self, picked, labels):
        """Each row's cross-entropy against its label, LOGIT_ROWS rows of logits at a time."""
        parts = []
        for j in range(0, picked.shape[0], LOGIT_ROWS):
            logp = log_softmax(self.logits(picked[j : j + LOGIT_ROWS]))  # float32 (n, V)
            y = labels[j : j + LOGIT_ROWS]
            parts.append(-mx.take_along_axis(logp, y[:, None], axis=1)[:, 0])
        return mx.concatenate(parts)

    def memory_budget(self) -> int:
        return default_budget()

    def kept_outputs(self) -> frozenset[str]:
        return frozenset()  # mx.vjp takes no given outputs: a recompute computes every linear

    def head_vjp(
        self,
        x,
        tokens: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
        scale: float,
        objective: Objective | None = None,
    ):
        r, c = mx.array(rows), mx.array(cols)
        labels = mx.array(tokens[rows, cols + 1])  # (N,): position t predicts t + 1

        def pick(h):
            return [self.final_norm(h)[r, c]]  # (N, hidden)

        if objective is not None:  # the weights first, then each chunk's vjp with its weights
            (picked,) = pick(x)
            ce = self._ces(picked, labels)
            mx.eval(ce)
            loss, weights = objective(np.array(ce), rows, cols)
            w, grads = mx.array(np.asarray(weights, np.float32)), []
            for j in range(0, len(rows), LOGIT_ROWS):
                y = labels[j : j + LOGIT_ROWS]
                _, (g,) = mx.vjp(
                    lambda p, y=y: [self._ces(p, y)],
                    [picked[j : j + LOGIT_ROWS]],
                    [w[j : j + LOGIT_ROWS]],
                )
                mx.eval(g)
                grads.append(g)
            _, (grad,) = mx.vjp(pick, [x], [mx.concatenate(grads, axis=0)])
            mx.eval(grad)
            return float(loss), grad

        def ce(p, y):
            logp = log_softmax(self.logits(p))  # float32 (n, V)
            return [-mx.sum(mx.take_along_axis(logp, y[:, None], axis=1))]

        (picked,) = pick(x)
        total, grads = mx.zeros((), dtype=mx.float32), []
        for j in range(0, len(rows), LOGIT_ROWS):  # never (N, vocab) at once
            y = labels[j : j + LOGIT_ROWS]
            (loss,), (g,) = mx.vjp(
                lambda p, y=y: ce(p, y), [picked[j : j + LOGIT_ROWS]], [mx.array(scale, mx.float32)]
            )
            total = total + loss
            grads.append(g)
            mx.eval(total, g)
        _, (grad,) = mx.vjp(pick, [x], [mx.concatenate(grads, axis=0)])
        total = total * scale
        mx.eval(total, grad)
        return float(total.item()), grad

    def adamw(self, opt: AdamW, names, params, m, v, grads) -> None:
        step_size, bc2_sqrt = adamw_factors(opt)
        lr, b1, b2 = opt.lr, opt.beta1, opt.beta2
        w = mx.array(1 - b1, mx.float32)  # m.lerp_(g, 1 - beta1)
        with mx.stream(mx.cpu):  # float64 exists on the CPU only; Apple's memory is shared
            for n in names:
                p, g, mn, vn = params[n], grads[n], m[n], v[n]
                if opt.weight_decay != 0:
                    p = p * (1 - lr * opt.weight_decay)
                if 1 - b1 < 0.5:  # torch's lerp picks its form by the weight
                    mn = fma(w, g - mn, mn)
                else:
                    mn = fma(w - 1, g - mn, g)
                vn = fma((1 - b2) * g, g, vn * b2)  # addcmul_: self + value * t1 * t2
                denom = mx.sqrt(vn) / bc2_sqrt + opt.eps
                p = p + (-step_size * mn) / denom  # addcdiv_: self + value * t1 / t2
                params[n], m[n], v[n] = p, mn, vn
                grads[n] = mx.zeros_like(g)
            mx.eval(params, m, v, grads)

    def close(self) -> None:
        self.reader.close()
        self.embed = self.norm = self.lm_head = None
