"""Phi-3 / Phi-4-mini: one decoder layer as a function of its weights (``layer``).

Weights are a dict keyed like the HF checkpoint below ``model.layers.<k>.``
(``self_attn.qkv_proj.weight``, ...); an adapter sits on a fused linear as a whole, as PEFT's does.
``lora`` maps a module name (``self_attn.qkv_proj``) to its adapter; None runs the base model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spill.engines.torch.ops import apply_rotary, attend, proj, rms_norm
from spill.models.config import ModelConfig


# The rotary turns the first ``cfg.rotary_dim`` features of each head (``partial_rotary_factor``)
# and passes the rest; its tables (longrope's short or long factors, times the attention factor)
# come in ``ctx``. With ``sliding_window`` set, every layer attends within it (``cfg.windowed``).
def rotate(x, cos, sin):
    """The rotary on the first ``cos.shape[-1]`` features of x (B, H, T, D), the rest as is."""
    r = cos.shape[-1]
    return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)


# Llama's layer without biases, with two fused linears: ``qkv_proj`` holds the query, key and value
# rows in that order, ``gate_up_proj`` the gate rows then the up rows.
def attention(cfg: ModelConfig, i: int, w: dict, x, ctx, cache, lora):
    b, t, _ = x.shape
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    qkv = proj(w, "self_attn.qkv_proj", x, lora)  # (B, T, (H + 2 KV) * D)
    q, k, v = qkv.split([heads * d, kv * d, kv * d], dim=-1)
    q = q.reshape(b, t, heads, d).transpose(1, 2)  # (B, H, T, D)
    k = k.reshape(b, t, kv, d).transpose(1, 2)  # (B, KV, T, D)
    v = v.reshape(b, t, kv, d).transpose(1, 2)
    q = rotate(q, ctx.cos, ctx.sin)
    k = rotate(k, ctx.cos, ctx.sin)
    if cache is not None:
        k, v = cache.update(k, v, ctx.start)  # (B, KV, S, D)
    o = attend(q, k, v, ctx.window if i in cfg.windowed else ctx.mask)  # (B, T, H * D)
    return proj(w, "self_attn.o_proj", o, lora)


def mlp(w: dict, x, lora):
    gate, up = proj(w, "mlp.gate_up_proj", x, lora).chunk(2, dim=-1)
    return proj(w, "mlp.down_proj", up * F.silu(gate), lora)


def layer(cfg: ModelConfig, i: int, w: dict, x, ctx, cache=None, lora=None):
    """Layer ``i``: x (B, T, hidden) -> (B, T, hidden); writes its keys/values into ``cache``."""
    eps = cfg.rms_norm_eps
    x = x + attention(cfg, i, w, rms_norm(x, w["input_layernorm.weight"], eps), ctx, cache, lora)
    return x + mlp(w, rms_norm(x, w["post_attention_layernorm.weight"], eps), lora)
