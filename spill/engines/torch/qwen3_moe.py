"""Qwen3-MoE: one decoder layer as a function of its weights.

Qwen3's attention (``qwen3.attention``), then in a sparse layer (``cfg.sparse``) the router
``mlp.gate`` picks each token's ``experts_per_token`` experts by softmax (float32), their weights
renormalized with ``norm_topk_prob``, and the token's output is the weighted sum of those experts'
SwiGLUs (``mlp.experts.<e>.gate_proj`` ...), added expert by expert in ascending order as
transformers' ``Qwen3MoeExperts`` adds them. Other layers have Qwen3's dense MLP. ``lora`` maps a
module name (``self_attn.q_proj``, ``mlp.experts.3.up_proj``) to its adapter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spill.engines.core.experts import need
from spill.engines.core.kernel import expert_lora
from spill.engines.torch.ops import proj, rms_norm
from spill.engines.torch.qwen3 import attention, mlp
from spill.models.config import ModelConfig


def route(cfg: ModelConfig, w: dict, x):
    """x (N, hidden) -> (weights (N, k) in x's dtype, experts (N, k)): the router's top k."""
    logits = proj(w, "mlp.gate", x, None)  # (N, experts)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, chosen = torch.topk(probs, cfg.experts_per_token, dim=-1)
    if cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), chosen


def expert(w: dict, e: int, h, lora):
    """Expert ``e``'s SwiGLU of h (M, hidden). A lone row is computed as the first of two equal
    rows: a one-row product is a matrix-vector one, whose bits on a CPU depend on where the
    weight sits (its address mod 16 bytes: a mapped layer's tensors lie at their file offsets,
    a read one's at 64-byte boundaries), a two-row one's not, so streamed == resident holds."""
    one = len(h) == 1
    h = h.expand(2, -1) if one else h
    pre = f"mlp.experts.{e}."
    h = F.silu(proj(w, pre + "gate_proj", h, lora)) * proj(w, pre + "up_proj", h, lora)
    h = proj(w, pre + "down_proj", h, lora)
    return h[:1] if one else h


def experts(cfg: ModelConfig, w: dict, x, lora):
    """x (B, T, hidden) -> the routed experts' weighted sum, (B, T, hidden)."""
    flat = x.reshape(-1, x.shape[-1])  # (N, hidden)
    top, chosen = route(cfg, w, flat)
    out = torch.zeros_like(flat)
    hit = chosen.unique().tolist()  # ascending
    need(w, hit)  # where experts stream: these are read, none other
    for e in hit:
        rows, slot = torch.where(chosen == e)  # the tokens routed to e, and at which rank
        on = expert_lora(
            lora, e, rows.cpu().numpy, x.shape[1], lambda at: torch.from_numpy(at).to(x.device)
        )
        h = expert(w, e, flat[rows], on) * top[rows, slot, None]
        out = out.index_add(0, rows, h)
    return out.view(x.shape)


def layer(cfg: ModelConfig, i: int, w: dict, x, ctx, cache=None, lora=None):
    """Layer ``i``: x (B, T, hidden) -> (B, T, hidden); writes its keys/values into ``cache``."""
    eps = cfg.rms_norm_eps
    x = x + attention(cfg, i, w, rms_norm(x, w["input_layernorm.weight"], eps), ctx, cache, lora)
    h = rms_norm(x, w["post_attention_layernorm.weight"], eps)
    return x + (experts(cfg, w, h, lora) if i in cfg.sparse else mlp(w, h, lora))
