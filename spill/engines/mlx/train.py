"""LoRA training through the streaming ring: the MLX ``Trainer``.

The torch trainer's algorithm. ``accumulate`` walks the ring twice. Forward keeps each layer's
input hidden state and nothing else; the final norm, lm_head and a float32 cross-entropy over
the target tokens give the loss and, through ``mx.vjp``, its gradient at the last layer's
output. Backward walks the ring in reverse and recomputes each layer from its saved input under
``mx.vjp`` with respect to that input and the layer's LoRA tensors, handing the input's gradient
down. Only one layer's graph exists at a time, and resident mode runs the very same code:
streamed and resident gradients are bit-identical.

LoRA dropout masks are a pure function of (``batch.dropout_seed``, layer, module): the module's
seed (``common.dropout_seed``, the hash torch uses too) keys ``mx.random``, so the recompute
draws the forward's masks. The masks differ from torch's generator; with dropout 0 the engines
compute the same function. ``apply`` is torch.optim.AdamW's single-tensor update on a CPU, op
for op and bit for bit: torch's ``lerp_`` and ``addcmul_`` kernels round a fused multiply-add
once, which ``fma`` reproduces through float64; bias corrections are Python floats; the step is
passed in.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from spill.engines.base import AdamW, TrainBatch
from spill.engines.common import (
    adamw_factors,
    check_batch,
    check_lora,
    check_params,
    dropout_seed,
    param_shapes,
)
from spill.engines.mlx.model import LOGIT_ROWS, Model, to_float32
from spill.engines.mlx.ops import log_softmax
from spill.errors import EngineError
from spill.models.lora import MODULES, LoraConfig, param_names


def dropout(p: float, seed: int):
    """Inverted dropout with probability ``p`` whose mask comes from ``seed`` alone."""

    def drop(h):  # h (B, T, in) float32
        keep = mx.random.uniform(shape=h.shape, key=mx.random.key(seed)) >= p  # (B, T, in)
        return h * keep * (1.0 / (1.0 - p))

    return drop


def fma(a, b, c):
    """``a * b + c`` rounded once, as torch's CPU kernels for ``lerp_`` and ``addcmul_`` compute
    it (a float32 product is exact in float64; the sum rounds to float32 as a fused op would)."""
    f64 = mx.float64
    return (a.astype(f64) * b.astype(f64) + c.astype(f64)).astype(mx.float32)


class MLXTrainer:
    """float32 LoRA parameters, AdamW moments and accumulated gradients as MLX arrays."""

    def __init__(self, model: Model, lora: LoraConfig):
        check_lora(lora)
        self.model, self.lora = model, lora
        self.names = param_names(model.cfg, lora)
        self._ready = False
        shapes = param_shapes(model.cfg, lora).items()
        self.params, self.m, self.v, self.grads = (
            {n: mx.zeros(s, dtype=mx.float32) for n, s in shapes} for _ in range(4)
        )

    # -- state -------------------------------------------------------------------------------

    def set_state(
        self, params: dict[str, np.ndarray], m: dict[str, np.ndarray], v: dict[str, np.ndarray]
    ) -> None:
        """Adopt copies of (params, m, v); empty moments mean zeros (a fresh run). Zeroes grads."""
        cfg = self.model.cfg
        check_params(cfg, self.lora, params, "trainer params")
        self.params = to_float32(params)
        for what, given in (("m", m), ("v", v)):
            if given:
                check_params(cfg, self.lora, given, f"trainer moment {what}")
                setattr(self, what, to_float32(given))
            else:
                setattr(self, what, {n: mx.zeros_like(p) for n, p in self.params.items()})
        self.grads = {n: mx.zeros_like(p) for n, p in self.params.items()}
        mx.eval(self.params, self.m, self.v, self.grads)
        self._ready = True

    def state(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
        def copy(arrays):
            return {n: np.array(arrays[n], dtype=np.float32, copy=True) for n in self.names}

        return copy(self.params), copy(self.m), copy(self.v)

    # -- forward and backward through the ring -----------------------------------------------

    def _layer_names(self, i: int) -> list[str]:
        return [f"layers.{i}.{MODULES[t]}.lora_{ab}" for t in self.lora.targets for ab in "ab"]

    def _layer_lora(self, i: int, seed: int, leaves: list) -> dict:
        """Layer ``i``'s adapters from ``leaves`` (A, B per target, in ``_layer_names`` order)."""
        out = {}
        for k, t in enumerate(self.lora.targets):
            module = MODULES[t]
            entry = (leaves[2 * k], leaves[2 * k + 1], self.lora.scale)
            if self.lora.dropout > 0:
                entry += (dropout(self.lora.dropout, dropout_seed(seed, i, module)),)
            out[module] = entry
        return out

    def _check(self, batch: TrainBatch):
        checked = check_batch(batch, self.model.cfg.vocab_size)
        if not self._ready:
            raise EngineError("the trainer has no state yet; call set_state first")
        return checked

    def _head(self, x, tokens: np.ndarray, rows: np.ndarray, cols: np.ndarray, scale: float):
        """Loss sum x scale of the targets, and its gradient at the last layer's output x."""
        m = self.model
        r, c = mx.array(rows), mx.array(cols)
        labels = mx.array(tokens[rows, cols + 1])  # (N,): position t predicts t + 1

        def pick(h):
            return [m.final_norm(h)[r, c]]  # (N, hidden)

        def ce(p, y):
            logp = log_softmax(m.logits(p))  # float32 (n, V)
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

    def accumulate(self, batch: TrainBatch) -> float:
        tokens, attention, targets = self._check(batch)
        rows, cols = np.nonzero(targets[:, 1:])  # the hidden state at cols predicts cols + 1
        if len(rows) == 0:
            return 0.0
        m, seed, layers = self.model, batch.dropout_seed, self.model.cfg.num_hidden_layers
        ids = mx.array(tokens)  # (B, T)
        ctx = m.context(mx.array(attention), 0, tokens.shape[1])
        saved: list = [None] * layers  # each layer's input (B, T, hidden)
        x = m.embed_ids(ids)
        for i, w in m.ring.walk(range(layers)):
            saved[i] = x
            names = self._layer_names(i)
            x = m.layer(w, x, ctx, None, self._layer_lora(i, seed, [self.params[n] for n in names]))
            mx.eval(x)
        loss, grad = self._head(x, tokens, rows, cols, batch.scale)
        for i, w in m.ring.walk(range(layers - 1, -1, -1)):
            x, saved[i] = saved[i], None
            names = self._layer_names(i)
            leaves = [self.params[n] for n in names]

            def step(h, *lv, i=i, w=w):
                return [m.layer(w, h, ctx, None, self._layer_lora(i, seed, list(lv)))]

            if i > 0:
                _, got = mx.vjp(step, [x, *leaves], [grad])
                grad, got = got[0], got[1:]
            else:  # nothing below layer 0 takes a gradient
                _, got = mx.vjp(lambda *lv, x=x, step=step: step(x, *lv), leaves, [grad])
                grad = None
            for name, g in zip(names, got, strict=True):
                self.grads[name] = self.grads[name] + g
            mx.eval([self.grads[n] for n in names], *([grad] if grad is not None else []))
        return loss

    # -- the optimizer -----------------------------------------------------------------------

    def apply(self, opt: AdamW) -> None:
        step_size, bc2_sqrt = adamw_factors(opt)
        lr, b1, b2 = opt.lr, opt.beta1, opt.beta2
        w = mx.array(1 - b1, mx.float32)  # m.lerp_(g, 1 - beta1)
        with mx.stream(mx.cpu):  # float64 exists on the CPU only; Apple's memory is shared
            for n in self.names:
                p, g, m, v = self.params[n], self.grads[n], self.m[n], self.v[n]
                if opt.weight_decay != 0:
                    p = p * (1 - lr * opt.weight_decay)
                if 1 - b1 < 0.5:  # torch's lerp picks its form by the weight
                    m = fma(w, g - m, m)
                else:
                    m = fma(w - 1, g - m, g)
                v = fma((1 - b2) * g, g, v * b2)  # addcmul_: self + value * t1 * t2
                denom = mx.sqrt(v) / bc2_sqrt + opt.eps
                p = p + (-step_size * m) / denom  # addcdiv_: self + value * t1 / t2
                self.params[n], self.m[n], self.v[n] = p, m, v
                self.grads[n] = mx.zeros_like(g)
            mx.eval(self.params, self.m, self.v, self.grads)
