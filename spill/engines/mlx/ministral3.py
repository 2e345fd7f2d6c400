"""Ministral 3 (text) in MLX: one decoder layer as a function of its weights.

Weights are a dict keyed like the HF checkpoint below ``model.layers.<k>.``
(``self_attn.q_proj.weight``, ...). Mistral's layer (a window on every layer when config.json
sets ``sliding_window``) whose rotary is YaRN's (the kernel's tables, scaled by its attention
factor) and whose queries, after the rotary, are multiplied by Llama 4's position-dependent
factor ``1 + beta * log(1 + floor(position / original))``, as transformers' Ministral3Attention.
``lora`` maps a module name (``self_attn.q_proj``) to its adapter; None runs the base model.
"""

from __future__ import annotations

import mlx.core as mx

from spill.engines.mlx.ops import apply_rotary, attend, proj, rms_norm, silu
from spill.models.config import ModelConfig


def query_factor(cfg: ModelConfig, positions):
    """(B, T) int32 positions -> (B, 1, T, 1) float32, as transformers' get_llama_4_attn_scale."""
    ratio = positions.astype(mx.float32) / cfg.rope_original
    scaling = 1 + cfg.query_beta * mx.log(1 + mx.floor(ratio))
    return scaling[:, None, :, None]


def attention(cfg: ModelConfig, i: int, w: dict, x, ctx, cache, lora):
    b, t, _ = x.shape
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = proj(w, "self_attn.q_proj", x, lora).reshape(b, t, heads, d).swapaxes(1, 2)  # (B, H, T, D)
    k = proj(w, "self_attn.k_proj", x, lora).reshape(b, t, kv, d).swapaxes(1, 2)  # (B, KV, T, D)
    v = proj(w, "self_attn.v_proj", x, lora).reshape(b, t, kv, d).swapaxes(1, 2)
    q = apply_rotary(q, ctx.cos, ctx.sin)
    k = apply_rotary(k, ctx.cos, ctx.sin)
    q = q * query_factor(cfg, ctx.positions).astype(q.dtype)
    if cache is not None:
        k, v = cache.update(k, v, ctx.start)  # (B, KV, S, D): every key, the mask picks
    o = attend(q, k, v, ctx.window if i in cfg.windowed else ctx.mask)  # (B, T, H * D)
    return proj(w, "self_attn.o_proj", o, lora)


def mlp(w: dict, x, lora):
    gate = silu(proj(w, "mlp.gate_proj", x, lora))
    return proj(w, "mlp.down_proj", gate * proj(w, "mlp.up_proj", x, lora), lora)


def layer(cfg: ModelConfig, i: int, w: dict, x, ctx, cache=None, lora=None):
    """Layer ``i``: x (B, T, hidden) -> (B, T, hidden); writes its keys/values into ``cache``."""
    eps = cfg.rms_norm_eps
    x = x + attention(cfg, i, w, rms_norm(x, w["input_layernorm.weight"], eps), ctx, cache, lora)
    return x + mlp(w, rms_norm(x, w["post_attention_layernorm.weight"], eps), lora)
