"""A 4-bit packed layer computed without a float copy: torch's CPU int4 weight-only matmul.

``engine.packed_matmul`` (``--packed-matmul``) keeps a 4-bit module in the layout of
``torch.ops.aten._weight_int4pack_mm_for_cpu`` (``repack``, ``linear``) instead of dequantizing it;
its numbers are not the dequantized path's, and the runner names these numerics ``bfloat16+int4mm``
wherever numerics are recorded. The kernel has no gradient: a tune dequantizes as before (its
numerics unchanged), and so is a module the kernel cannot take (8-bit, output rows not a multiple of
64, a group size other than 32-256).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from spill.engines.torch.quant import Packed
from spill.models.weights import WeightFiles

# Not the dequantized path's numbers: scales and biases round to bfloat16 and the kernel sums in its
# own order.
NUMERICS = "bfloat16+int4mm"
ROWS = 64  # the kernel takes a matrix whose output rows are a multiple of this
GROUPS = (32, 64, 128, 256)
# a module's two tensors in the kernel's file (``int4_file``): its uint8 words and bf16 scales
# and zeros, named ``<module>.<part>``
WORDS, SCALE_ZERO = "int4_words", "int4_scale_zero"


@dataclass(frozen=True)
class Int4Weight:
    """One linear's weight as the kernel takes it."""

    packed: torch.Tensor  # uint8 (out, in / 2), the kernel's layout
    scale_zero: torch.Tensor  # bfloat16 (in / group_size, out, 2)
    group_size: int
    buffer: torch.Tensor | None = None  # the read buffer both view (None: their own memory)

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape[0], self.packed.shape[1] * 2


def accepts(bits: int, group_size: int, shape: tuple[int, int]) -> bool:
    """Whether the kernel takes a packed (out, in) matrix of ``bits`` in groups of
    ``group_size``."""
    out, cols = shape
    return (
        bits == 4
        and out % ROWS == 0
        and group_size in GROUPS
        and cols % group_size == 0
        and block() is not None
    )


@functools.cache
def block() -> int | None:
    """Output rows per block of the kernel's layout on this CPU, which torch picks by its
    vector width: 64 with AVX-512, 32 on AVX2 (an AMD EPYC here); None when torch's own
    conversion of a probe matches neither (the kernel is then not used)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (ROWS, 64), generator=gen, dtype=torch.int32)
    want = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    words = torch.zeros(ROWS, 8, dtype=torch.int64)
    for n in range(8):  # spill's packing: element k of a word in bits 4k..4k+3
        words |= q[:, n::8].to(torch.int64) << (4 * n)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    for rows in (64, 32):
        if torch.equal(_layout(words.view(torch.uint8), ROWS, 64, rows), want):
            return rows
    return None


def eligible(p: Packed) -> bool:
    return accepts(p.bits, p.group_size, p.shape)


# The layout: per block of ``n`` output rows (64 with AVX-512, 32 on AVX2: ``block`` asks torch
# once), for each input column ``k``, ``n/2`` bytes, byte ``j`` holding row ``j``'s value in its low
# nibble and row ``j + n/2``'s in its high one (what ``_convert_weight_to_int4pack_for_cpu`` writes
# from int32 values, tested equal). ``repack`` makes it from spill's packed words with a few byte
# ops and one transpose, once per model (``int4_file`` keeps it on disk). The kernel's affine form
# is ``(q - 8) * scale + zero``, so ``zero = bias + 8 * scale``, both held in bfloat16 (the kernel
# takes them in the activations' dtype; its float32 path is scalar, ~50x slower here).
def repack(p: Packed) -> Int4Weight:
    """``p`` (4-bit, ``eligible``) in the kernel's layout."""
    rows, cols = p.shape
    out = _layout(p.weight.view(torch.uint8), rows, cols, block())
    s, b = p.scales.to(torch.float32), p.biases.to(torch.float32)  # (rows, groups)
    zero = b + 8 * s
    scale_zero = torch.stack((s.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()
    return Int4Weight(out, scale_zero, p.group_size)


def _layout(words: torch.Tensor, rows: int, cols: int, n: int) -> torch.Tensor:
    """spill's packed bytes of a (rows, cols) 4-bit matrix in the kernel's layout for blocks of
    ``n`` output rows: row ``j`` of a block in each byte's low nibble, row ``j + n/2`` in its
    high one, column-major within the block."""
    src = words.view(rows // n, 2, n // 2, cols // 2)  # (b, 2, n/2, h)
    lo, hi = src[:, 0], src[:, 1]  # rows j and j + n/2 of each block: (b, n/2, h)
    even = (lo & 15) | (hi << 4)  # column 2m: each byte's low nibble
    odd = (lo >> 4) | (hi & 0xF0)  # column 2m + 1: each byte's high nibble
    pairs = torch.stack((even, odd), dim=-1)  # (b, n/2, h, 2)
    out = torch.empty((rows, cols // 2), dtype=torch.uint8)
    out.view(rows // n, cols // 2, 2, n // 2).copy_(pairs.permute(0, 2, 3, 1))
    return out


def held(kernel_file: WeightFiles, quantized: dict) -> list[str]:
    """The weight names of ``quantized`` whose kernel layout ``kernel_file`` (the index of the
    kernel's file) holds."""
    return [
        n for n in quantized if f"{n.removesuffix('.weight')}.{WORDS}" in kernel_file.tensor_shard
    ]


def linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for x (..., in) in bfloat16."""
    flat = x.reshape(-1, x.shape[-1])
    if not flat.is_contiguous():
        flat = flat.contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, w.packed, w.group_size, w.scale_zero)
    y = y.view(*x.shape[:-1], w.packed.shape[0])
    return y if bias is None else y + bias
