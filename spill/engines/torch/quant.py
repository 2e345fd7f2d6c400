"""Packed affine layers (``spill.models.quant``) and their dequantization into the compute dtype.

A ``Packed`` is one quantized linear as read: the int32 words, scales and biases (views of one read
buffer). ``dequantize_into`` writes ``scale * q + bias`` into the output tensor as two separate
float32 ops, never a fused multiply-add (one rounding instead of two would break the equality with
the float folder); ``dequantize`` returns them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHUNK_VALUES = 1 << 22  # values per chunk of a non-float32 output (a 16 MB float32 scratch)


@dataclass(frozen=True)
class Packed:
    """One quantized linear's weight as stored; ``buffer`` is the read buffer the three view
    (shared by a layer's modules, recycled whole)."""

    weight: torch.Tensor  # int32 (out, in * bits / 32)
    scales: torch.Tensor  # (out, in / group_size)
    biases: torch.Tensor  # (out, in / group_size)
    bits: int
    group_size: int
    buffer: torch.Tensor  # uint8

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape[0], self.weight.shape[1] * 32 // self.bits


# The words are viewed as bytes (little-endian, as every machine torch runs on), a 4-bit byte holds
# element ``2k`` in its low nibble and ``2k + 1`` in its high one (``& 15``, ``>> 4``), an 8-bit
# byte is the value itself.
def _values(out: torch.Tensor, words: torch.Tensor, bits: int) -> None:
    """out (n, in) <- the integers of ``words`` uint8 (n, in * bits / 8)."""
    if bits == 8:
        out.copy_(words)
        return
    pairs = out.view(out.shape[0], -1, 2)  # (n, in / 2, 2): low nibble first
    pairs[..., 0].copy_(words & 15)
    pairs[..., 1].copy_(words >> 4)


# The values land in the output, which is then multiplied and added in place. A bf16/f16 output goes
# through one float32 scratch buffer per call, in chunks. Measured on a SmolLM2 layer (4-bit g32,
# float32, one thread): 3.7 ms against 21.5 ms for the previous int32 shift-and-mask version
# (bench/quant_ring.py).
def dequantize_into(
    out: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fill ``out`` (rows, in) with the dequantized values of ``weight`` int32 (rows, words),
    ``scales`` and ``biases`` (rows, in / group_size); a non-float32 ``out`` goes through
    ``scratch`` (float32, at least ``CHUNK_VALUES`` or the whole matrix; else a new one)."""
    rows, cols = out.shape
    words = weight.view(torch.uint8)  # (rows, words * 4)
    s = scales.to(torch.float32).unsqueeze(-1)  # (rows, groups, 1)
    b = biases.to(torch.float32).unsqueeze(-1)
    if out.dtype == torch.float32:
        _values(out, words, bits)
        groups = out.view(rows, -1, group_size)  # (rows, groups, G)
        groups.mul_(s)
        groups.add_(b)
        return out
    step = max(1, CHUNK_VALUES // max(cols, 1))
    need = min(step, rows) * cols  # <= max(CHUNK_VALUES, cols) values
    if scratch is None or scratch.numel() < need or scratch.device != out.device:
        scratch = torch.empty(need, dtype=torch.float32, device=out.device)
    scratch = scratch[:need].view(min(step, rows), cols)
    for r in range(0, rows, step):
        x = scratch[: min(step, rows - r)]  # (n, in)
        _values(x, words[r : r + step], bits)
        groups = x.view(x.shape[0], -1, group_size)
        groups.mul_(s[r : r + step])
        groups.add_(b[r : r + step])
        out[r : r + step].copy_(x)
    return out


def dequantize(p: Packed, out: torch.Tensor, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``p``'s values in ``out`` (``p.shape``, the compute dtype)."""
    return dequantize_into(out, p.weight, p.scales, p.biases, p.bits, p.group_size, scratch)
