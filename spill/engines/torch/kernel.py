"""The torch kernel (``TorchKernel``): one model's resident parts and the primitives
``spill.engines.core`` runs. The family module (``llama``, ``qwen3``, ...) is picked once from the
config; it supplies the layer function. The budget for kept activations is the ring's default: half
the memory available on the device now. Sampling runs on the CPU in float32 with one
``torch.Generator`` per row. LoRA dropout masks come from a seeded ``torch.Generator`` on the
model's device. ``adamw`` is torch.optim.AdamW's single-tensor update, op for op (``lerp_`` for the
first moment, bias corrections in Python floats).
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from spill.engines.base import AdamW, Objective
from spill.engines.core.common import adamw_factors, long_rope
from spill.engines.core.kernel import LOGIT_ROWS, family_modules
from spill.engines.torch.ops import (
    Context,
    KVCache,
    base_outputs,
    context,
    inv_freq,
    rms_norm,
    unused_outputs,
)
from spill.engines.torch.reader import WeightReader, default_budget
from spill.models.config import ModelConfig

FAMILIES: dict[str, ModuleType] = family_modules("spill.engines.torch")
# A recomputed layer's output only roots its graph: the last linear's base output, added to the
# residual, is read by no backward formula (every family ends a layer with mlp.down_proj), unless
# a post-feedforward norm reads it (Gemma's, whose backward needs its input).
RECOMPUTE_UNUSED = frozenset({"mlp.down_proj"})
# Linears whose base outputs a streamed forward may keep for the recompute: a layer's linears
# (cfg.linears) but down_proj (whose output the recompute never reads), so a recomputed layer
# runs no base matmul forward, only its adapters and the elementwise ops; ~9.4 MB a SmolLM2
# layer at 4 x 128 tokens.
UNKEPT = frozenset({"mlp.down_proj"})


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    """One token from float32 logits (V,): temperature, then the top-p nucleus."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p >= 1.0:
        return int(torch.multinomial(probs, 1, generator=gen))
    p, order = probs.sort(descending=True, stable=True)
    keep = (p.cumsum(0) - p) < top_p
    keep[0] = True  # the most likely token is always in the nucleus
    return int(order[torch.multinomial(p * keep, 1, generator=gen)])


def dropout(p: float, seed: int):
    """Inverted dropout with probability ``p`` whose mask comes from ``seed`` alone."""

    def drop(h):  # h (B, T, in) float32
        gen = torch.Generator(device=h.device).manual_seed(seed)
        keep = torch.rand(h.shape, generator=gen, device=h.device) >= p  # (B, T, in)
        return h * keep * (1.0 / (1.0 - p))

    return drop


class TorchKernel:
    def __init__(self, cfg: ModelConfig, reader: WeightReader):
        self.cfg, self.reader = cfg, reader
        self.family = FAMILIES[cfg.family]
        self.device, self.dtype = reader.device, reader.dtype
        self.itemsize = self.dtype.itemsize
        self.embed = reader.tensor("model.embed_tokens.weight")  # (V, hidden)
        self.norm = reader.tensor("model.norm.weight")
        tied = cfg.tie_word_embeddings or not reader.has("lm_head.weight")
        self.lm_head = self.embed if tied else reader.tensor("lm_head.weight")
        self.freq = inv_freq(cfg).to(self.device)
        self.long_freq = inv_freq(cfg, long=True).to(self.device) if cfg.rope_long else None
        self.kept = frozenset(cfg.linears) - UNKEPT
        local = cfg.local_rope_theta
        self.local_freq = None if local is None else inv_freq(cfg, local).to(self.device)
        # Gemma's sqrt(hidden) as transformers multiplies it: a float32 scalar in the model's dtype
        self.embed_scale = torch.tensor(cfg.embed_scale).to(self.dtype)
        self.unused = frozenset() if cfg.feedforward_norms else RECOMPUTE_UNUSED

    # -- arrays in and out ---------------------------------------------------------------------
    def array(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device)

    def params(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return {
            n: torch.tensor(
                np.asarray(a, dtype=np.float32), dtype=torch.float32, device=self.device
            )
            for n, a in arrays.items()
        }

    def numpy(self, x: torch.Tensor) -> np.ndarray:
        return x.detach().to("cpu", copy=True).numpy()

    def zeros_like(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    def sync(self, *xs) -> None:
        pass  # eager: every op has been issued, and CUDA orders them on one stream

    def inference(self):
        return torch.inference_mode()

    # -- the model ---------------------------------------------------------------------------
    def context(self, valid: np.ndarray, start: int, length: int) -> Context:
        window = self.cfg.sliding_window if self.cfg.windowed else None
        freq = self.long_freq if long_rope(self.cfg, valid, start, length) else self.freq
        scale = self.cfg.rope_attention
        return context(
            self.array(valid), start, length, freq, self.dtype, window, self.local_freq, scale
        )

    def caches(self, batch: int, length: int) -> list[KVCache]:
        c = self.cfg
        return [
            KVCache(batch, c.num_key_value_heads, length, c.head_dim, self.dtype, self.device)
            for _ in range(c.num_hidden_layers)
        ]

    def keep_rows(self, caches: list[KVCache], rows: np.ndarray) -> None:
        idx = torch.as_tensor(rows, device=self.device)
        for c in caches:
            c.k, c.v = c.k[idx], c.v[idx]  # (B', KV, L, D) copies; the old ones are freed

    def rebuild(self, parts, length: int) -> list[KVCache]:
        out = self.caches(sum(len(rows) for _, rows, _, _ in parts), length)
        for i, new in enumerate(out):
            first = 0
            for caches, rows, lo, at in parts:
                old, idx = caches[i], torch.as_tensor(rows, device=self.device)
                n = min(old.k.shape[2] - lo, length - at)
                span = slice(first, first + len(rows))
                new.k[span, :, at : at + n] = old.k[idx, :, lo : lo + n]
                new.v[span, :, at : at + n] = old.v[idx, :, lo : lo + n]
                first += len(rows)
        return out

    def embed_ids(self, ids):
        x = F.embedding(ids, self.embed)  # (B, T, hidden)
        return x if self.cfg.embed_scale == 1.0 else x * self.embed_scale

    def layer(self, i: int, w: dict, x, ctx: Context, cache=None, lora=None, outputs=None):
        if outputs is None:
            return self.family.layer(self.cfg, i, w, x, ctx, cache, lora)
        with base_outputs(self.kept, outputs):
            return self.family.layer(self.cfg, i, w, x, ctx, cache, lora)

    def final_norm(self, x):
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps, self.cfg.norm_offset)

    def logits(self, h):
        """h (N, hidden) -> float32 logits (N, V)."""
        return F.linear(h, self.lm_head).float()

    def log_probs(self, h, targets) -> np.ndarray:
        logp = torch.log_softmax(self.logits(h), dim=-1)  # (N, V) float32
        return logp.gather(1, targets[:, None])[:, 0].cpu().numpy()

    def sampler(self, seed: int):
        gen = torch.Generator().manual_seed(seed)

        def draw(logits: np.ndarray, temperature: float, top_p: float) -> int:
            return sample(torch.from_numpy(logits), temperature, top_p, gen)

        return draw

    # -- training ------------------------------------------------------------------------------
    def dropout(self, p: float, seed: int):
        return dropout(p, seed)

    # Gradients come from autograd one layer at a time (``layer_vjp``, the recompute walk) or from
    # one graph over the whole resident stack (``stack_vjp``, kept activations: the same layer ops
    # in the same order, then ``head_vjp``, so the same bits). A recomputed layer skips
    # ``down_proj``'s base matmul (``ops.unused_outputs``): its output roots the graph only, and its
    # input gradient keeps its bits. When the trainer gives ``layer`` a dict, the forward keeps
    # every other linear's base output in it (``ops.base_outputs``) and ``layer_vjp`` takes them
    # from there instead of recomputing them: no base matmul is run twice.
    def layer_vjp(self, i, w, x, ctx, leaves, lora, grad, wrt_input: bool, outputs=None):
        with torch.enable_grad():
            leaves = [a.detach().requires_grad_() for a in leaves]
            if wrt_input:
                x = x.detach().requires_grad_()
            with unused_outputs(self.unused):  # out's value is never read
                out = self.layer(i, w, x, ctx, None, lora(leaves), outputs)
            wrt = [*leaves, x] if wrt_input else leaves
            got = _zeros_if_unused(wrt, torch.autograd.grad(out, wrt, grad, allow_unused=True))
        return (got[-1] if wrt_input else None), list(got[: len(leaves)])

    def stack_vjp(self, ws, x, ctx, leaves, loras, tokens, rows, cols, scale, objective=None):
        with torch.enable_grad():
            leaves = [[a.detach().requires_grad_() for a in group] for group in leaves]
            for i, (w, group, lora) in enumerate(zip(ws, leaves, loras, strict=True)):
                x = self.layer(i, w, x, ctx, None, lora(group))
            loss, grad = self.head_vjp(x, tokens, rows, cols, scale, objective)
            flat = [a for group in leaves for a in group]
            got = iter(
                _zeros_if_unused(flat, torch.autograd.grad(x, flat, grad, allow_unused=True))
            )
        return loss, [[next(got) for _ in group] for group in leaves]

    def memory_budget(self) -> int:
        return default_budget(self.device)

    def kept_outputs(self) -> frozenset[str]:
        return self.kept

    # The head's cross-entropy backs through lm_head in chunks of rows so (N, vocab) never exists at
    # once.
    def head_vjp(
        self,
        x,
        tokens: np.ndarray,
        rows: np.ndarray,
        cols: np.ndarray,
        scale: float,
        objective: Objective | None = None,
    ):
        if objective is not None:
            return self._objective_vjp(x, tokens, rows, cols, objective)
        ids = self.array(tokens)  # (B, T)
        r, c = self.array(rows), self.array(cols)
        h = x.detach().requires_grad_()
        with torch.enable_grad():
            picked = self.final_norm(h)[r, c]  # (N, hidden): position t predicts t + 1
            labels = ids[r, c + 1]  # (N,)
            leaf = picked.detach().requires_grad_()
            total = torch.zeros((), dtype=torch.float32, device=self.device)
            for j in range(0, len(labels), LOGIT_ROWS):  # never (N, vocab) at once
                logits = self.logits(leaf[j : j + LOGIT_ROWS])  # float32
                ce = F.cross_entropy(logits, labels[j : j + LOGIT_ROWS], reduction="sum")
                (ce * scale).backward()
                total += ce.detach()
            (grad,) = torch.autograd.grad(picked, h, leaf.grad)
        return float(total * scale), grad

    def target_ces(self, x, tokens, rows, cols) -> np.ndarray:
        ids = self.array(tokens)
        r, c = self.array(rows), self.array(cols)
        with torch.no_grad():
            picked = self.final_norm(x)[r, c]
            labels = ids[r, c + 1]
            out = [
                F.cross_entropy(
                    self.logits(picked[j : j + LOGIT_ROWS]),
                    labels[j : j + LOGIT_ROWS],
                    reduction="none",
                )
                for j in range(0, len(labels), LOGIT_ROWS)
            ]
        return torch.cat(out).cpu().numpy()

    # A target's cross-entropy depends on its own row of the head's input alone, so one backward
    # of each chunk's summed cross-entropy leaves every row's own gradient; the objective's weight
    # of each target (known once every cross-entropy is) then scales its row.
    def _objective_vjp(self, x, tokens, rows, cols, objective: Objective):
        ids = self.array(tokens)
        r, c = self.array(rows), self.array(cols)
        h = x.detach().requires_grad_()
        with torch.enable_grad():
            picked = self.final_norm(h)[r, c]
            labels = ids[r, c + 1]
            leaf = picked.detach().requires_grad_()
            ces = []
            for j in range(0, len(labels), LOGIT_ROWS):
                logits = self.logits(leaf[j : j + LOGIT_ROWS])
                ce = F.cross_entropy(logits, labels[j : j + LOGIT_ROWS], reduction="none")
                ce.sum().backward()
                ces.append(ce.detach())
            loss, weights = objective(torch.cat(ces).cpu().numpy(), rows, cols)
            w = torch.as_tensor(np.asarray(weights, np.float32), device=self.device)
            (grad,) = torch.autograd.grad(picked, h, leaf.grad * w[:, None])
        return float(loss), grad

    def adamw(self, opt: AdamW, names, params, m, v, grads) -> None:
        step_size, bc2_sqrt = adamw_factors(opt)
        lr, b1, b2 = opt.lr, opt.beta1, opt.beta2
        with torch.no_grad():
            for n in names:
                p, g, mn, vn = params[n], grads[n], m[n], v[n]
                if opt.weight_decay != 0:
                    p.mul_(1 - lr * opt.weight_decay)
                mn.lerp_(g, 1 - b1)
                vn.mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (vn.sqrt() / bc2_sqrt).add_(opt.eps)
                p.addcdiv_(mn, denom, value=-step_size)
                g.zero_()

    def close(self) -> None:
        self.reader.close()
        self.embed = self.norm = self.lm_head = None


def _zeros_if_unused(wrt, got) -> list:
    """autograd's gradients with zeros for a leaf the graph never used (an expert's adapter no
    token was routed to: mx.vjp gives zeros there too)."""
    return [torch.zeros_like(a) if g is None else g for a, g in zip(wrt, got, strict=True)]
