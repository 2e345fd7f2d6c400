"""Packed affine layers (``spill.models.quant``) dequantized into the compute dtype with torch.

The packed words are read as int32 (the same bits); each value is a shift and a mask away, then
``scale * q + bias`` in float32 as two separate ops (never a fused multiply-add, which would
round once instead of twice and break equality with the float folder), then the cast. Rows go
in chunks so the int32 and float32 temporaries stay a few MB whatever the tensor.
"""

from __future__ import annotations

import torch

CHUNK_VALUES = 1 << 22  # values per chunk: ~16 MB of int32 and of float32 temporaries


def dequantize_into(
    out: torch.Tensor,
    weight: torch.Tensor,
    scales: torch.Tensor,
    biases: torch.Tensor,
    bits: int,
    group_size: int,
) -> torch.Tensor:
    """Fill ``out`` (rows, in) with the dequantized values of ``weight`` int32 (rows, words),
    ``scales`` and ``biases`` (rows, in / group_size)."""
    rows, cols = out.shape
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=weight.device)  # (32 / bits,)
    mask = (1 << bits) - 1
    step = max(1, CHUNK_VALUES // max(cols, 1))
    for r in range(0, rows, step):
        w = weight[r : r + step]
        q = (w.unsqueeze(-1) >> shifts) & mask  # (n, words, 32 / bits): arithmetic shift, masked
        q = q.reshape(w.shape[0], -1, group_size).to(torch.float32)  # (n, groups, G)
        x = q * scales[r : r + step].to(torch.float32).unsqueeze(-1)
        x = x + biases[r : r + step].to(torch.float32).unsqueeze(-1)
        out[r : r + step].copy_(x.reshape(w.shape[0], cols))
    return out
