"""SmolLM3 in MLX: one decoder layer as a function of its weights.

Weights are a dict keyed like the HF checkpoint below ``model.layers.<k>.``
(``self_attn.q_proj.weight``, ...). Llama's layer (biases follow ``attention_bias`` and
``mlp_bias``), except that the layers in ``cfg.no_rope`` (NoPE: ``no_rope_layers`` or every
``no_rope_layer_interval``-th) rotate neither queries nor keys; with ``use_sliding_window`` the
layers in ``cfg.windowed`` attend within ``sliding_window`` keys. ``lora`` maps a module name
(``self_attn.q_proj``) to its adapter; None runs the base model.
"""

from __future__ import annotations

from spill.engines.mlx.ops import apply_rotary, attend, proj, rms_norm, silu
from spill.models.config import ModelConfig


def attention(cfg: ModelConfig, i: int, w: dict, x, ctx, cache, lora):
    b, t, _ = x.shape
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = proj(w, "self_attn.q_proj", x, lora).reshape(b, t, heads, d).swapaxes(1, 2)  # (B, H, T, D)
    k = proj(w, "self_attn.k_proj", x, lora).reshape(b, t, kv, d).swapaxes(1, 2)  # (B, KV, T, D)
    v = proj(w, "self_attn.v_proj", x, lora).reshape(b, t, kv, d).swapaxes(1, 2)
    if i not in cfg.no_rope:
        q = apply_rotary(q, ctx.cos, ctx.sin)
        k = apply_rotary(k, ctx.cos, ctx.sin)
    if cache is not None:
        k, v = cache.update(k, v, ctx.start)  # (B, KV, S, D)
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
