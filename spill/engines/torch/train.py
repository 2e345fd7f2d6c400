"""LoRA training through the streaming ring: the torch ``Trainer``.

``accumulate`` walks the ring twice. Forward, without autograd, it keeps each layer's input
hidden state and nothing else; the final norm, lm_head and a float32 cross-entropy over the
target tokens give the loss and its gradient at the last layer's output. Backward walks the ring
in reverse, recomputes each layer from its saved input with autograd on for that layer's LoRA
tensors and its input, and hands the input's gradient down. So only one layer's graph exists at a
time, and resident mode runs the very same code (its ring just never evicts): streamed and
resident gradients are bit-identical.

LoRA dropout masks are a pure function of (``batch.dropout_seed``, layer, module), drawn from a
seeded ``torch.Generator`` on the runner's device, so the recompute draws the forward's masks.
``apply`` is torch.optim.AdamW's single-tensor update, op for op (``lerp_`` for the first moment,
bias corrections in Python floats), with the step count passed in: the trainer carries no
hidden counters, and ``state()`` is everything needed to continue exactly.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from spill.engines.base import AdamW, TrainBatch
from spill.engines.common import (
    adamw_factors,
    check_batch,
    check_lora,
    check_params,
    dropout_seed,
    param_shapes,
)
from spill.engines.torch.model import LOGIT_ROWS, Model, to_float32
from spill.errors import EngineError
from spill.models.lora import MODULES, LoraConfig, param_names


def dropout(p: float, seed: int):
    """Inverted dropout with probability ``p`` whose mask comes from ``seed`` alone."""

    def drop(h):  # h (B, T, in) float32
        gen = torch.Generator(device=h.device).manual_seed(seed)
        keep = torch.rand(h.shape, generator=gen, device=h.device) >= p  # (B, T, in)
        return h * keep * (1.0 / (1.0 - p))

    return drop


class TorchTrainer:
    """float32 LoRA parameters, AdamW moments and accumulated gradients on the runner's device."""

    def __init__(self, model: Model, lora: LoraConfig):
        check_lora(lora)
        self.model, self.lora = model, lora
        self.names = param_names(model.cfg, lora)
        self._ready = False

        def zeros(shapes):
            return {n: torch.zeros(s, dtype=torch.float32, device=model.device) for n, s in shapes}

        shapes = param_shapes(model.cfg, lora).items()
        self.params, self.m, self.v, self.grads = (zeros(shapes) for _ in range(4))

    # -- state -------------------------------------------------------------------------------

    def set_state(
        self, params: dict[str, np.ndarray], m: dict[str, np.ndarray], v: dict[str, np.ndarray]
    ) -> None:
        """Adopt copies of (params, m, v); empty moments mean zeros (a fresh run). Zeroes grads."""
        cfg, dev = self.model.cfg, self.model.device
        check_params(cfg, self.lora, params, "trainer params")
        self.params = to_float32(params, dev)
        for what, given in (("m", m), ("v", v)):
            if given:
                check_params(cfg, self.lora, given, f"trainer moment {what}")
                setattr(self, what, to_float32(given, dev))
            else:
                setattr(self, what, {n: torch.zeros_like(p) for n, p in self.params.items()})
        for g in self.grads.values():
            g.zero_()
        self._ready = True

    def state(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
        def copy(tensors):
            return {n: tensors[n].to("cpu", copy=True).numpy() for n in self.names}

        return copy(self.params), copy(self.m), copy(self.v)

    # -- forward and backward through the ring -----------------------------------------------

    def _layer_lora(self, i: int, seed: int, leaves: dict | None = None) -> dict:
        """Layer ``i``'s adapters; with ``leaves``, fresh autograd leaves recorded there."""
        out = {}
        for t in self.lora.targets:
            module = MODULES[t]
            stem = f"layers.{i}.{module}"
            a, b = self.params[stem + ".lora_a"], self.params[stem + ".lora_b"]
            if leaves is not None:
                a = leaves[stem + ".lora_a"] = a.detach().requires_grad_()
                b = leaves[stem + ".lora_b"] = b.detach().requires_grad_()
            entry = (a, b, self.lora.scale)
            if self.lora.dropout > 0:
                entry += (dropout(self.lora.dropout, dropout_seed(seed, i, module)),)
            out[module] = entry
        return out

    def _check(self, batch: TrainBatch):
        checked = check_batch(batch, self.model.cfg.vocab_size)
        if not self._ready:
            raise EngineError("the trainer has no state yet; call set_state first")
        return checked

    def _head(self, x, ids, rows, cols, scale: float):
        """Loss sum x scale of the targets, and its gradient at the last layer's output x."""
        m = self.model
        h = x.detach().requires_grad_()
        with torch.enable_grad():
            picked = m.final_norm(h)[rows, cols]  # (N, hidden): position t predicts t + 1
            labels = ids[rows, cols + 1]  # (N,)
            leaf = picked.detach().requires_grad_()
            total = torch.zeros((), dtype=torch.float32, device=m.device)
            for j in range(0, len(labels), LOGIT_ROWS):  # never (N, vocab) at once
                logits = m.logits(leaf[j : j + LOGIT_ROWS])  # float32
                ce = F.cross_entropy(logits, labels[j : j + LOGIT_ROWS], reduction="sum")
                (ce * scale).backward()
                total += ce.detach()
            (grad,) = torch.autograd.grad(picked, h, leaf.grad)
        return float(total * scale), grad

    def accumulate(self, batch: TrainBatch) -> float:
        tokens, attention, targets = self._check(batch)
        rows, cols = np.nonzero(targets[:, 1:])  # the hidden state at cols predicts cols + 1
        if len(rows) == 0:
            return 0.0
        m, seed = self.model, batch.dropout_seed
        dev, layers = m.device, m.cfg.num_hidden_layers
        ids = torch.from_numpy(tokens).to(dev)  # (B, T)
        ctx = m.context(torch.from_numpy(attention).to(dev), 0, ids.shape[1])
        saved: list = [None] * layers  # each layer's input (B, T, hidden)
        with torch.no_grad():
            x = m.embed_ids(ids)
            for i, w in m.ring.walk(range(layers)):
                saved[i] = x
                x = m.layer(w, x, ctx, None, self._layer_lora(i, seed))
        r = torch.from_numpy(rows).to(dev)
        c = torch.from_numpy(cols).to(dev)
        loss, grad = self._head(x, ids, r, c, batch.scale)
        for i, w in m.ring.walk(range(layers - 1, -1, -1)):
            x, saved[i] = saved[i], None
            leaves: dict[str, torch.Tensor] = {}
            with torch.enable_grad():
                if i > 0:  # nothing below layer 0 takes a gradient
                    x.requires_grad_()
                out = m.layer(w, x, ctx, None, self._layer_lora(i, seed, leaves))
                wrt = [*leaves.values(), x] if i > 0 else list(leaves.values())
                got = torch.autograd.grad(out, wrt, grad)
            for name, g in zip(leaves, got, strict=False):
                self.grads[name] += g
            grad = got[-1] if i > 0 else None
        return loss

    # -- the optimizer -----------------------------------------------------------------------

    def apply(self, opt: AdamW) -> None:
        step_size, bc2_sqrt = adamw_factors(opt)
        lr, b1, b2 = opt.lr, opt.beta1, opt.beta2
        with torch.no_grad():
            for n in self.names:
                p, g, m, v = self.params[n], self.grads[n], self.m[n], self.v[n]
                if opt.weight_decay != 0:
                    p.mul_(1 - lr * opt.weight_decay)
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / bc2_sqrt).add_(opt.eps)
                p.addcdiv_(m, denom, value=-step_size)
                g.zero_()
