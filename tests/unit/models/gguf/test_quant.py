"""GGUF blocks mapped onto affine groups without loss: dequantizing spill's packed copy gives
exactly ``gguf.quants.dequantize``'s float32 values for every mapped type, also after the q/k
row permutation the importer undoes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from spill.models import quant
from spill.models.gguf import quant as gguf_quant
from spill.models.gguf.importer import _unpermute

ROWS, COLS = 48, 512  # two K-quant super-blocks per row; 8 heads of 6 rows for the permutation
D_AT = {T.Q6_K: (208, 210)}  # where a block keeps its fp16 d (and dmin after it, K-quants)


def _blocks(qtype, seed: int) -> tuple[np.ndarray, str]:
    """A (ROWS, bytes per row) tensor of ``qtype``: gguf's own quantizer where it has one,
    else random bytes with sane fp16 d and dmin (and every sub-scale and quant value random)."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((ROWS, COLS)) * rng.choice([1e-3, 0.05, 4.0], (ROWS, 1))).astype(
        np.float32
    )
    w[0] = 0.0
    w[1] = 0.25
    try:
        return gguf_quantize(w, qtype), "quantize"
    except NotImplementedError:
        pass
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (ROWS, COLS // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    lo, hi = D_AT.get(qtype, (0, 4))
    d = rng.standard_normal((blocks.shape[0], (hi - lo) // 2)) * rng.choice([1e-4, 1e-2, 1.0])
    blocks[:, lo:hi] = d.astype(np.float16).view(np.uint8)  # signed, finite, many exponents
    return raw, "random"


def _spill_dequantized(raw: np.ndarray, qtype, heads: int = 0) -> np.ndarray:
    q, scales, biases, spec = gguf_quant.to_affine(raw, qtype, (ROWS, COLS))
    weight = quant.pack(q, spec.bits)
    if heads:  # rows of the packed weight, scales and biases move together
        weight, scales, biases = (_unpermute(a, heads) for a in (weight, scales, biases))
    return quant.dequantize(weight, scales, biases, spec.bits, spec.group_size)


@pytest.mark.parametrize("qtype", list(gguf_quant.SPECS), ids=lambda t: t.name)
@pytest.mark.parametrize("seed", [0, 1])
def test_affine_copy_equals_gguf_dequantize(qtype, seed):
    raw, how = _blocks(qtype, seed)
    want = gguf_dequantize(raw, qtype)
    assert want.dtype == np.float32 and want.shape == (ROWS, COLS)
    got = _spill_dequantized(raw, qtype)
    assert np.array_equal(got, want), how
    # bit for bit except the sign of a zero (d * 0 keeps d's sign; 8d + -8d is +0)
    differ = got.view(np.uint32) != want.view(np.uint32)
    assert (want[differ] == 0).all()


@pytest.mark.parametrize("qtype", list(gguf_quant.SPECS), ids=lambda t: t.name)
def test_unpermuted_rows_stay_exact(qtype):
    raw, _ = _blocks(qtype, 5)
    want = _unpermute(gguf_dequantize(raw, qtype), 8)
    assert np.array_equal(_spill_dequantized(raw, qtype, heads=8), want)


def test_table_of_specs():
    assert gguf_quant.SPECS[T.Q4_1] == quant.Spec(4, 32)
    assert gguf_quant.SPECS[T.Q8_0] == quant.Spec(8, 32)
    assert gguf_quant.SPECS[T.Q6_K] == quant.Spec(8, 16)
    raw = np.zeros((2, 256 // 256 * GGML_QUANT_SIZES[T.Q2_K][1]), np.uint8)
    assert gguf_quant.to_affine(raw, T.Q2_K, (2, 256)) is None  # dequantized on import instead
