"""Qwen3-MoE in MLX: one decoder layer as a function of its weights.

Qwen3's attention (``qwen3.attention``), then in a sparse layer (``cfg.sparse``) the router
``mlp.gate`` picks each token's ``experts_per_token`` experts by softmax (float32), their weights
renormalized with ``norm_topk_prob``, and the token's output is the weighted sum of those experts'
SwiGLUs (``mlp.experts.<e>.gate_proj`` ...), added expert by expert in ascending order as the
torch engine and transformers add them. Other layers have Qwen3's dense MLP. ``lora`` maps a
module name (``self_attn.q_proj``, ``mlp.experts.3.up_proj``) to its adapter.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from spill.engines.core.experts import need
from spill.engines.core.kernel import expert_lora
from spill.engines.mlx.ops import proj, rms_norm, silu
from spill.engines.mlx.qwen3 import attention, mlp
from spill.models.config import ModelConfig


def route(cfg: ModelConfig, w: dict, x):
    """x (N, hidden) -> (weights (N, k) in x's dtype, experts (N, k) numpy): the router's top k,
    each row's largest first (as ``torch.topk``), so a renormalization sums them in its order."""
    logits = proj(w, "mlp.gate", x, None)  # (N, experts)
    probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
    picked = mx.stop_gradient(probs)
    mx.eval(picked)
    order = np.argsort(-np.array(picked), axis=-1, kind="stable")
    chosen = order[:, : cfg.experts_per_token]  # (N, k), the choice as data
    top = mx.take_along_axis(probs, mx.array(chosen), axis=-1)  # (N, k) float32
    if cfg.norm_topk_prob:
        top = top / top.sum(axis=-1, keepdims=True)
    return top.astype(logits.dtype), chosen


# Which tokens go to which expert is data: ``route`` evaluates the choice to numpy inside the layer
# (``mx.eval`` is allowed inside ``mx.vjp``, unlike ``mx.compile``); each routed expert multiplies
# only its tokens' rows, gathered by an index array and added back by ``out.at[rows].add``, both
# differentiable. The choice carries no gradient (as torch's ``topk`` indices), the chosen
# probabilities do. Experts are never stacked: a layer reads only the experts its tokens chose.
def experts(cfg: ModelConfig, w: dict, x, lora):
    """x (B, T, hidden) -> the routed experts' weighted sum, (B, T, hidden)."""
    flat = x.reshape(-1, x.shape[-1])  # (N, hidden)
    top, chosen = route(cfg, w, flat)
    out = mx.zeros_like(flat)
    hit = np.unique(chosen).tolist()  # ascending
    need(w, hit)  # where experts stream: these are read, none other
    for e in hit:
        rows, slot = np.nonzero(chosen == e)  # the tokens routed to e, and at which rank
        pre, on = f"mlp.experts.{e}.", expert_lora(lora, e, rows.copy, x.shape[1], mx.array)
        r = mx.array(rows)
        h = flat[r]  # (n, hidden)
        h = silu(proj(w, pre + "gate_proj", h, on)) * proj(w, pre + "up_proj", h, on)
        h = proj(w, pre + "down_proj", h, on) * top[r, mx.array(slot)][:, None]
        out = out.at[r].add(h)  # a token meets an expert once: no row repeats
    return out.reshape(x.shape)


def layer(cfg: ModelConfig, i: int, w: dict, x, ctx, cache=None, lora=None):
    """Layer ``i``: x (B, T, hidden) -> (B, T, hidden); writes its keys/values into ``cache``."""
    eps = cfg.rms_norm_eps
    x = x + attention(cfg, i, w, rms_norm(x, w["input_layernorm.weight"], eps), ctx, cache, lora)
    h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
    return x + (experts(cfg, w, h, lora) if i in cfg.sparse else mlp(w, h, lora))
