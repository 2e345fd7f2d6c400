"""Math the families share, in MLX: RMSNorm, rotary tables, the adapter-aware linear, attention.

Op for op the torch engine's ``ops`` (norm in float32, rotate_half rotary, repeated KV heads,
softmax over a boolean mask), so float32 log-probs agree with torch to about 1e-6. Weights are plain
dicts keyed like the HF checkpoint; the same functions run on a ring slot or a resident layer. MLX
is lazy: callers ``mx.eval`` after each layer, so a released slot is really free. A quantized base's
weight is a ``Packed`` record under the same key (``...q_proj.weight``); every dequantization is in
float32 then the compute dtype, as the torch engine computes every packed value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np

from spill.engines.core.kernel import RowAdapters
from spill.models.config import ModelConfig

# x with at least this many rows multiplies a packed matrix dequantized, through the BLAS, on a
# CPU; fewer rows (a small decode batch) keep quantized_matmul, as a GPU always does. Measured
# with ``python bench/quant_mlx.py rows`` (docs/quantized.md): from 8 rows the dequantized product
# is no slower on any shape measured (SmolLM2's layer 0.34x, a 1B model's MLP matrix 0.65x, a
# 49152-row 8-bit head 0.99x); at 4 the small ones win (0.50x) and the large ones lose (1.3-2.5x).
# ``linear`` multiplies a ``Packed`` weight with ``mx.quantized_matmul`` (mlx has its vjp with
# respect to ``x``, which is all the frozen base needs), except on a CPU when ``x`` has at least
# ``DENSE_ROWS`` rows: mlx's CPU quantized kernels are not vectorized (SmolLM2's layer at 512 rows:
# 1437 ms against 45 ms to dequantize and multiply through the BLAS), so there the matrix is
# dequantized per use and multiplied in float (``dense_matmul_t``, whose vjp dequantizes again: a
# one-graph backward never holds a layer's float matrix from its forward).
DENSE_ROWS = 8


@dataclass
class Packed:
    """One affine-quantized matrix (out, in) as mlx-lm stores it: ``weight`` uint32
    (out, in * bits / 32), ``scales`` and ``biases`` (out, in / group_size) in their stored
    dtype; ``dtype`` is the compute dtype its products come back in."""

    weight: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int
    dtype: mx.Dtype
    dense_rows: int | None = None  # x of at least this many rows: dequantized per use (CPU)

    def arrays(self) -> list[mx.array]:
        return [self.weight, self.scales, self.biases]

    def rows(self, ids) -> mx.array:
        """The dequantized rows ``ids`` (any shape) -> (*ids.shape, in) in the compute dtype."""
        s, b = self.scales[ids], self.biases[ids]
        return _dequantize(self.weight[ids], s, b, self.group_size, self.bits, self.dtype)


def _dequantize(w, scales, biases, group_size: int, bits: int, dtype):
    """(out, in) in ``dtype``: ``scale * q + bias`` in float32, then cast."""
    f32 = mx.float32
    full = mx.dequantize(
        w, scales.astype(f32), biases.astype(f32), group_size=group_size, bits=bits
    )
    return full.astype(dtype)


@cache
def dense_matmul_t(group_size: int, bits: int, dtype) -> Callable:
    """``f(x, weight, scales, biases) = x @ dequantize(...).T``, whose vjp with respect to ``x``
    dequantizes again (``g @ W``): in a lazy graph the float matrix lives inside one product only.
    The packed arrays are frozen; their cotangents are zeros nothing evaluates."""

    @mx.custom_function
    def product(x, w, scales, biases):
        return x @ _dequantize(w, scales, biases, group_size, bits, dtype).T

    @product.vjp
    def product_vjp(primals, cotangent, output):
        _, w, scales, biases = primals
        gx = cotangent @ _dequantize(w, scales, biases, group_size, bits, dtype)
        return gx, mx.zeros_like(w), mx.zeros_like(scales), mx.zeros_like(biases)

    return product


def matmul_t(x, w):
    """``x @ w.T`` for a float matrix or a ``Packed`` one (out, in); x (..., in) -> (..., out)."""
    if isinstance(w, Packed):
        rows = x.size // x.shape[-1]
        if w.dense_rows is not None and rows >= w.dense_rows:
            f = dense_matmul_t(w.group_size, w.bits, w.dtype)
            return f(x, w.weight, w.scales, w.biases).astype(x.dtype)
        y = mx.quantized_matmul(
            x, w.weight, w.scales, w.biases, transpose=True, group_size=w.group_size, bits=w.bits
        )
        return y.astype(x.dtype)  # float32 or float16 scales promote a bf16 product
    return x @ w.T


# A packed table: the packed rows of the ids are taken and only those dequantized.
def embedding(table, ids):
    """Rows ``ids`` (B, T) of an embedding table (V, hidden) -> (B, T, hidden)."""
    return table.rows(ids) if isinstance(table, Packed) else table[ids]


# An adapter on one linear: A (in, r), B (r, out) in float32, its scale (alpha / r), and
# optionally a dropout applied to the adapter's float32 input (training only).
Lora = tuple[mx.array, mx.array, float] | tuple[mx.array, mx.array, float, Callable]


def linear(x, w, b=None, lora: Lora | RowAdapters | None = None):
    """``x @ w.T + b`` (``w`` float or ``Packed``), plus the low-rank update ``(drop(x) @ A @ B) * scale`` in float32."""
    y = matmul_t(x, w)
    if b is not None:
        y = y + b
    if isinstance(lora, RowAdapters):  # per row: rows in no part add nothing
        delta = mx.zeros(y.shape, dtype=mx.float32)
        for rows, (a, bb, scale, *_) in lora.parts:
            delta[rows] = ((x[rows].astype(mx.float32) @ a) @ bb) * scale
        return y + delta.astype(y.dtype)
    if lora is not None:
        a, bb, scale, *drop = lora
        h = x.astype(mx.float32)
        if drop:
            h = drop[0](h)
        y = y + (((h @ a) @ bb) * scale).astype(y.dtype)
    return y


def proj(w: dict, name: str, x, lora: dict[str, Lora] | None):
    """The linear called ``name`` (``self_attn.q_proj``) of a layer's weight dict."""
    adapter = lora.get(name) if lora else None
    return linear(x, w[name + ".weight"], w.get(name + ".bias"), adapter)


def silu(x):
    return x / (1 + mx.exp(-x))  # torch's CPU kernel's form


def log_softmax(x):
    """Over the last axis, as torch computes it: shift by the max, subtract log-sum-exp."""
    shifted = x - mx.stop_gradient(mx.max(x, axis=-1, keepdims=True))
    return shifted - mx.log(mx.sum(mx.exp(shifted), axis=-1, keepdims=True))


def rms_norm(x, weight, eps: float, offset: float = 0.0):
    """RMSNorm scaled by ``weight``, or with an ``offset`` by ``offset + weight`` in float32
    (Gemma's ``x * (1 + w)``), cast back last."""
    dtype = x.dtype
    h = x.astype(mx.float32)
    h = h * mx.rsqrt(mx.mean(h * h, axis=-1, keepdims=True) + eps)
    if offset:
        return (h * (offset + weight.astype(mx.float32))).astype(dtype)
    return weight * h.astype(dtype)


def gelu_tanh(x):
    """gelu's tanh approximation, as torch's ``gelu(approximate="tanh")`` writes it."""
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


def inv_freq(cfg: ModelConfig, theta: float | None = None, long: bool = False) -> mx.array:
    """Rotary inverse frequencies (float32), with Llama 3 scaling when the config has it; a
    ``theta`` given (the sliding layers' own base) means the plain rotary of that base."""
    dim = cfg.rotary_dim  # head_dim, or its leading part (``partial_rotary_factor``)
    base = cfg.rope_theta if theta is None else theta
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    if cfg.rope_short and theta is None:  # longrope: over short_factor, or long_factor if ``long``
        factors = np.asarray(cfg.rope_long if long else cfg.rope_short, dtype=np.float32)
        return mx.array(np.float32(1.0) / (factors * np.float32(base) ** exponent))
    freq = (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)
    scaling = cfg.rope_scaling_dict
    if scaling and theta is None and cfg.rope_kind == "yarn":
        return mx.array(yarn(np.float32(base) ** exponent, dim, base, scaling))
    if scaling and theta is None:
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old / low, old / high
        wavelen = np.float32(2 * math.pi) / freq
        scaled = np.where(wavelen > low_wavelen, freq / np.float32(factor), freq)
        smooth = (np.float32(old) / wavelen - np.float32(low)) / np.float32(high - low)
        smoothed = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        freq = np.where(medium, smoothed, scaled).astype(np.float32)
    return mx.array(freq)


def yarn(pos_freqs, dim: int, base: float, scaling: dict) -> np.ndarray:
    """YaRN's inverse frequencies (float32) as transformers' ``_compute_yarn_parameters``: a
    linear ramp between the interpolated (over ``factor``) and the plain ones across the
    dimensions whose rotations over the original length lie between beta_slow and beta_fast;
    ``pos_freqs`` (D/2,) is base ** (2i / dim)."""
    old = scaling["original_max_position_embeddings"]

    def dimension(rotations):
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dimension(scaling["beta_fast"]), dimension(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    steps = np.arange(dim // 2, dtype=np.float32)
    ramp = np.clip((steps - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)  # (D/2,)
    one = np.float32(1.0)
    inter = one / (np.float32(scaling["factor"]) * pos_freqs)
    return (inter * (1 - extrapolation) + (one / pos_freqs) * extrapolation).astype(np.float32)


def rotary(positions, freq, dtype, scale: float = 1.0):
    """cos and sin tables for integer positions (B, T) -> (B, T, D) each, in ``dtype``; times
    ``scale`` in float32 first (longrope's attention factor)."""
    freqs = positions[..., None].astype(mx.float32) * freq  # (B, T, D/2)
    emb = mx.concatenate([freqs, freqs], axis=-1)
    cos, sin = mx.cos(emb), mx.sin(emb)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.astype(dtype), sin.astype(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


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
        k = mx.repeat(k, groups, axis=1)
        v = mx.repeat(v, groups, axis=1)
    scores = (q @ k.swapaxes(-1, -2)) * (d**-0.5 if scale is None else scale)  # (B, H, T, S)
    scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    o = mx.softmax(scores, axis=-1, precise=True) @ v  # (B, H, T, D)
    return o.swapaxes(1, 2).reshape(b, t, heads * d)


@dataclass
class Context:
    """What every layer of one forward shares: rotary tables, the mask, the cache offset."""

    cos: mx.array  # (B, T, D)
    sin: mx.array  # (B, T, D)
    mask: mx.array  # (B, 1, T, S) bool, True where a query may attend a key
    start: int  # where this chunk's keys go in a KV cache
    window: mx.array | None = None  # ``mask`` less the keys a sliding window has left behind
    local: tuple[mx.array, mx.array] | None = None  # windowed layers' own (cos, sin)
    positions: mx.array | None = None  # (B, T) int32, each query's position

    def rotary(self, windowed: bool) -> tuple[mx.array, mx.array]:
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
    to itself only (its output is never used), which keeps the softmax free of all-masked rows.
    With a sliding ``window``, ``Context.window`` keeps only the keys less than ``window`` places
    back (transformers' ``kv_idx > q_idx - sliding_window``); valid tokens are contiguous (left
    padding in a generation, right padding in training), so places count positions. With
    ``local_freq``, ``Context.local`` holds the windowed layers' own rotary tables; ``scale``
    multiplies the (full layers') tables.
    """
    s = valid.shape[1]
    counts = mx.cumsum(valid.astype(mx.int32), axis=-1) - 1
    positions = mx.maximum(counts, 0)[:, start : start + length]  # (B, T)
    local = None if local_freq is None else rotary(positions, local_freq, dtype)
    cos, sin = rotary(positions, freq, dtype, scale)
    query = mx.arange(start, start + length)[:, None]  # (T, 1)
    key = mx.arange(s)[None, :]  # (1, S)
    causal = key <= query  # (T, S)
    mask = (causal[None] & valid[:, None, :]) | (key == query)[None]  # (B, T, S)
    slid = None if window is None else mask & (key > query - window)[None]  # (B, T, S)
    slid = None if slid is None else slid[:, None]
    return Context(cos, sin, mask[:, None], start, slid, local, positions)


class KVCache:
    """One layer's keys and values, preallocated for the whole generation."""

    def __init__(self, batch: int, kv_heads: int, length: int, head_dim: int, dtype):
        self.k = mx.zeros((batch, kv_heads, length, head_dim), dtype=dtype)
        self.v = mx.zeros_like(self.k)

    def update(self, k, v, start: int):
        """Write k, v (B, KV, T, D) at ``start``; return all keys and values so far."""
        end = start + k.shape[2]
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]

    def arrays(self) -> list[mx.array]:
        return [self.k, self.v]
