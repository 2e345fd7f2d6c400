"""Math the families share: RMSNorm, rotary tables, the adapter-aware linear, attention, masks.

The op order follows transformers' Llama and Qwen2 modules (norm in float32, rotate_half rotary,
repeated KV heads into SDPA), so float32 log-probs agree with them to about 1e-6. Weights are plain
dicts keyed like the HF checkpoint, so the same functions run on a ring slot or a resident layer and
give bit-identical results. ``unused_outputs`` and ``base_outputs`` let a recomputed layer (the
backward walk's) skip base matmuls with gradients that keep their bits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spill.engines.core.kernel import RowAdapters
from spill.engines.torch import int4
from spill.models.config import ModelConfig

# An adapter on one linear: A (in, r), B (r, out) in float32, its scale (alpha / r), and
# optionally a dropout applied to the adapter's float32 input (training only).
Lora = (
    tuple[torch.Tensor, torch.Tensor, float]
    | tuple[torch.Tensor, torch.Tensor, float, Callable[[torch.Tensor], torch.Tensor]]
)


_UNUSED: ContextVar[frozenset[str]] = ContextVar("spill_unused_outputs", default=frozenset())
# (names to record, {name: base output}): recording when the dict starts empty, else replaying
_BASE: ContextVar[tuple[frozenset[str], dict] | None] = ContextVar("spill_base", default=None)


# Two ways a recomputed layer skips base matmuls, both recording only the input gradient ``grad @
# W``, the very ``mm`` autograd runs for ``F.linear``, so gradients keep their bits:
# ``unused_outputs`` names linears whose base output nobody reads (no backward formula reads
# ``down_proj``'s output); ``base_outputs`` records chosen linears' base outputs during the streamed
# forward and hands them to the recompute, which then takes them instead of computing them again
# (the same bits: the same matmul on the same input).
@contextmanager
def unused_outputs(names: frozenset[str]) -> Iterator[None]:
    """Within: the base output of the linears called ``names`` is never read (see the comment
    above); their value is a zero placeholder, their input gradient exact."""
    token = _UNUSED.set(names)
    try:
        yield
    finally:
        _UNUSED.reset(token)


@contextmanager
def base_outputs(names: frozenset[str], outputs: dict) -> Iterator[None]:
    """Within: with ``outputs`` empty, the linears called ``names`` store their base output
    (``x @ W.T + b``, before any adapter) in it; with ``outputs`` filled, they take it from
    there instead of computing it and record only their input gradient."""
    token = _BASE.set((names, outputs))
    try:
        yield
    finally:
        _BASE.reset(token)


class _InputGradOnly(torch.autograd.Function):
    """``F.linear(x, w)``'s graph with a given output ``y`` (a zero placeholder when None):
    backward is ``grad @ W`` as ``MmBackward`` computes it for ``F.linear`` on the folded
    (N, in) input."""

    @staticmethod
    def forward(ctx, x, w, y=None):
        ctx.save_for_backward(w)
        ctx.shape = x.shape
        if y is None:
            return x.new_zeros(()).expand(*x.shape[:-1], w.shape[0])  # (..., out), no memory
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return grad.reshape(-1, grad.shape[-1]).mm(w).view(ctx.shape), None, None


def base(x, w, b=None):
    """``x @ w.T + b`` for a float weight or a 4-bit one in the int4 kernel's layout."""
    if isinstance(w, int4.Int4Weight):
        return int4.linear(x, w, b)
    return F.linear(x, w, b)


def linear(x, w, b=None, lora: Lora | None = None):
    """``x @ w.T + b``, plus the low-rank update ``(drop(x) @ A @ B) * scale`` in float32."""
    return with_adapter(base(x, w, b), x, lora)


def with_adapter(y, x, lora: Lora | RowAdapters | None):
    """A linear's base output ``y`` plus its adapter's update of the input ``x`` (per row with
    ``RowAdapters``)."""
    if isinstance(lora, RowAdapters):
        delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
        for rows, (a, bb, scale, *_) in lora.parts:
            delta[rows] = (x[rows].float() @ a) @ bb * scale
        return y + delta.to(y.dtype)
    if lora is not None:
        a, bb, scale, *drop = lora
        h = x.float()
        if drop:
            h = drop[0](h)
        y = y + ((h @ a) @ bb * scale).to(y.dtype)
    return y


def proj(w: dict, name: str, x, lora: dict[str, Lora] | None):
    """The linear called ``name`` (``self_attn.q_proj``) of a layer's weight dict."""
    weight, bias = w[name + ".weight"], w.get(name + ".bias")
    names, outputs = _BASE.get() or ((), None)
    if name in names and name in outputs:  # replaying the forward's base output
        given = outputs[name]
        y = _InputGradOnly.apply(x, weight, given) if x.requires_grad else given
    elif name in _UNUSED.get() and x.requires_grad:
        y = _InputGradOnly.apply(x, weight)
    else:
        y = base(x, weight, bias)
        if name in names:
            outputs[name] = y
    return with_adapter(y, x, lora.get(name) if lora else None)


def rms_norm(x, weight, eps: float, offset: float = 0.0):
    """RMSNorm scaled by ``weight``, or with an ``offset`` by ``offset + weight`` in float32
    (Gemma's ``x * (1 + w)``), cast back last."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if offset:
        return (h * (offset + weight.float())).to(dtype)
    return weight * h.to(dtype)


def inv_freq(cfg: ModelConfig, theta: float | None = None, long: bool = False) -> torch.Tensor:
    """Rotary inverse frequencies (float32), with Llama 3 scaling when the config has it; a
    ``theta`` given (the sliding layers' own base) means the plain rotary of that base."""
    dim = cfg.rotary_dim  # head_dim, or its leading part (``partial_rotary_factor``)
    base = cfg.rope_theta if theta is None else theta
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if cfg.rope_short and theta is None:  # longrope: over short_factor, or long_factor if ``long``
        factors = torch.tensor(cfg.rope_long if long else cfg.rope_short, dtype=torch.float32)
        return 1.0 / (factors * base**exponent)
    freq = 1.0 / (base**exponent)
    scaling = cfg.rope_scaling_dict
    if not scaling or theta is not None:
        return freq
    if cfg.rope_kind == "yarn":
        return yarn(base**exponent, dim, base, scaling)
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn(pos_freqs, dim: int, base: float, scaling: dict) -> torch.Tensor:
    """YaRN's inverse frequencies as transformers' ``_compute_yarn_parameters``: a linear ramp
    between the interpolated (over ``factor``) and the plain frequencies across the dimensions
    whose rotations over the original length lie between beta_slow and beta_fast; ``pos_freqs``
    (D/2,) is base ** (2i / dim)."""
    old = scaling["original_max_position_embeddings"]

    def dimension(rotations):
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension(scaling["beta_fast"]), dimension(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # (D/2,)
    return (1.0 / (scaling["factor"] * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation


def rotary(positions, freq, dtype, scale: float = 1.0):
    """cos and sin tables for integer positions (B, T) -> (B, T, D) each, in ``dtype``; times
    ``scale`` in float32 first (longrope's attention factor)."""
    freqs = positions[..., None].float() * freq  # (B, T, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x, cos, sin):
    """x (B, H, T, D); cos, sin (B, T, D)."""
    cos, sin = cos[:, None], sin[:, None]
    return (x * cos) + (rotate_half(x) * sin)


def attend(q, k, v, mask, scale: float | None = None):
    """q (B, H, T, D); k, v (B, KV, S, D); mask (B, 1, T, S) bool -> (B, T, H * D); the scores
    scaled by ``scale`` (None: D ** -0.5)."""
    b, heads, t, d = q.shape
    groups = heads // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=d**-0.5 if scale is None else scale
    )
    return o.transpose(1, 2).reshape(b, t, heads * d)


@dataclass
class Context:
    """What every layer of one forward shares: rotary tables, the mask, the cache offset."""

    cos: torch.Tensor  # (B, T, D)
    sin: torch.Tensor  # (B, T, D)
    mask: torch.Tensor  # (B, 1, T, S) bool, True where a query may attend a key
    start: int  # where this chunk's keys go in a KV cache
    window: torch.Tensor | None = None  # ``mask`` less the keys a sliding window has left behind
    local: tuple[torch.Tensor, torch.Tensor] | None = None  # windowed layers' own (cos, sin)
    positions: torch.Tensor | None = None  # (B, T) int64, each query's position

    def rotary(self, windowed: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of a layer: the windowed layers' own when the model has them."""
        return self.local if windowed and self.local is not None else (self.cos, self.sin)


def context(
    valid,
    start: int,
    length: int,
    freq,
    dtype,
    window: int | None = None,
    local_freq=None,
    scale: float = 1.0,
) -> Context:
    """Context for ``length`` tokens at ``start`` given valid keys (B, S), S = start + length.

    Positions count valid tokens, so left padding shifts nothing. A padding query may attend
    to itself only (its output is never used), which keeps SDPA free of all-masked rows.
    With a sliding ``window``, ``Context.window`` keeps only the keys less than ``window`` places
    back (transformers' ``kv_idx > q_idx - sliding_window``); valid tokens are contiguous (left
    padding in a generation, right padding in training), so places count positions. With
    ``local_freq``, ``Context.local`` holds the windowed layers' own rotary tables; ``scale``
    multiplies the (full layers') tables.
    """
    s = valid.shape[1]
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, start : start + length]  # (B, T)
    local = None if local_freq is None else rotary(positions, local_freq, dtype)
    cos, sin = rotary(positions, freq, dtype, scale)
    query = torch.arange(start, start + length, device=valid.device)[:, None]  # (T, 1)
    key = torch.arange(s, device=valid.device)[None, :]  # (1, S)
    causal = key <= query  # (T, S)
    mask = (causal[None] & valid[:, None, :]) | (key == query)[None]  # (B, T, S)
    slid = None if window is None else mask & (key > query - window)[None]  # (B, T, S)
    slid = None if slid is None else slid[:, None]
    return Context(cos, sin, mask[:, None], start, slid, local, positions)


class KVCache:
    """One layer's keys and values, preallocated for the whole generation."""

    def __init__(self, batch: int, kv_heads: int, length: int, head_dim: int, dtype, device):
        self.k = torch.zeros(batch, kv_heads, length, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)

    def update(self, k, v, start: int):
        """Write k, v (B, KV, T, D) at ``start``; return all keys and values so far."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]
