"""Gemma 3 (text) in MLX: one decoder layer as a function of its weights (``layer``).

Weights are a dict keyed like the HF checkpoint below ``model.layers.<k>.``
(``self_attn.q_proj.weight``, ``pre_feedforward_layernorm.weight``, ...). The embedding's
sqrt(hidden) scale and the tied head live in the kernel (``cfg.embed_scale``). ``lora`` maps a
module name (``self_attn.q_proj``) to its adapter; None runs the base model.
"""

from __future__ import annotations

from spill.engines.mlx.ops import apply_rotary, attend, gelu_tanh, proj, rms_norm
from spill.models.config import ModelConfig


# Every RMSNorm scales by ``1 + w`` in float32 (``cfg.norm_offset``).
def norm(cfg: ModelConfig, w: dict, name: str, x):
    return rms_norm(x, w[name + ".weight"], cfg.rms_norm_eps, cfg.norm_offset)


# Queries and keys pass per-head q/k norms before the rotary; scores are scaled by
# ``query_pre_attn_scalar`` ** -0.5 (``cfg.query_scale``). The layers in ``cfg.windowed`` attend
# within ``sliding_window`` keys and rotate by their own base (``ctx.rotary``); the others attend to
# every key with the global base.
def attention(cfg: ModelConfig, i: int, w: dict, x, ctx, cache, lora):
    b, t, _ = x.shape
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = proj(w, "self_attn.q_proj", x, lora).reshape(b, t, heads, d)  # (B, T, H, D)
    k = proj(w, "self_attn.k_proj", x, lora).reshape(b, t, kv, d)  # (B, T, KV, D)
    q = norm(cfg, w, "self_attn.q_norm", q).swapaxes(1, 2)  # (B, H, T, D)
    k = norm(cfg, w, "self_attn.k_norm", k).swapaxes(1, 2)  # (B, KV, T, D)
    v = proj(w, "self_attn.v_proj", x, lora).reshape(b, t, kv, d).swapaxes(1, 2)
    windowed = i in cfg.windowed
    cos, sin = ctx.rotary(windowed)
    q = apply_rotary(q, cos, sin)
    k = apply_rotary(k, cos, sin)
    if cache is not None:
        k, v = cache.update(k, v, ctx.start)  # (B, KV, S, D): every key, the mask picks
    o = attend(q, k, v, ctx.window if windowed else ctx.mask, cfg.query_scale)  # (B, T, H * D)
    return proj(w, "self_attn.o_proj", o, lora)


# The MLP is gated by gelu (tanh approximation).
def mlp(w: dict, x, lora):
    gate = gelu_tanh(proj(w, "mlp.gate_proj", x, lora))
    return proj(w, "mlp.down_proj", gate * proj(w, "mlp.up_proj", x, lora), lora)


# Four norms a layer: ``input_layernorm`` before the attention and ``post_attention_layernorm`` on
# its output, ``pre_feedforward_layernorm`` before the MLP and ``post_feedforward_layernorm`` on its
# output, each output then added to the residual.
def layer(cfg: ModelConfig, i: int, w: dict, x, ctx, cache=None, lora=None):
    """Layer ``i``: x (B, T, hidden) -> (B, T, hidden); writes its keys/values into ``cache``."""
    a = attention(cfg, i, w, norm(cfg, w, "input_layernorm", x), ctx, cache, lora)
    x = x + norm(cfg, w, "post_attention_layernorm", a)
    m = mlp(w, norm(cfg, w, "pre_feedforward_layernorm", x), lora)
    return x + norm(cfg, w, "post_feedforward_layernorm", m)
