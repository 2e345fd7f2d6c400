"""spill's affine quantizer against MLX's own, bit for bit (skipped where MLX is missing), and
the packing and dequantizing it rests on."""

from __future__ import annotations

import numpy as np
import pytest

from spill.errors import ModelError
from spill.models import quant
from spill.store.safetensors_io import float32_to_bf16_bits

PAIRS = [(b, g) for b in quant.BITS for g in quant.GROUP_SIZES]


def _matrix(seed: int, rows: int = 40, cols: int = 256) -> np.ndarray:
    """Random rows at many magnitudes, plus the edge rows a quantizer can get wrong."""
    rng = np.random.default_rng(seed)
    scale = rng.choice([1e-6, 1e-3, 1.0, 300.0], size=(rows, 1))
    w = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    w[0] = 0.0  # all zeros
    w[1] = 3.5  # constant, positive
    w[2] = -2.0  # constant, negative
    w[3] = np.linspace(-1, 1, cols)  # symmetric
    w[4] = 6e4  # large (still finite in float16)
    w[5] = -1e-30  # tiny
    w[6, ::2], w[6, 1::2] = 1.0, -1.0  # both edges the same magnitude
    w[7] = np.abs(w[7])  # one-signed
    w[8] = -np.abs(w[8])
    return w


def test_pack_is_little_endian_within_the_word():
    q = np.arange(8, dtype=np.uint8)[None, :]  # one row: 0, 1, ..., 7
    assert quant.pack(q, 4)[0, 0] == 0x76543210
    q8 = np.array([[1, 2, 3, 250]], dtype=np.uint8)
    assert quant.pack(q8, 8)[0, 0] == (250 << 24) | (3 << 16) | (2 << 8) | 1


@pytest.mark.parametrize("bits", quant.BITS)
def test_unpack_inverts_pack(bits):
    q = np.random.default_rng(bits).integers(0, 1 << bits, (5, 64), dtype=np.uint8)
    packed = quant.pack(q, bits)
    assert packed.dtype == np.uint32 and packed.shape == (5, 64 * bits // 32)
    assert np.array_equal(quant.unpack(packed, bits), q)


@pytest.mark.parametrize(("bits", "group"), PAIRS)
def test_dequantize_is_scale_times_q_plus_bias(bits, group):
    rng = np.random.default_rng(7)
    q = rng.integers(0, 1 << bits, (3, 256), dtype=np.uint8)
    s = rng.standard_normal((3, 256 // group)).astype(np.float32)
    b = rng.standard_normal((3, 256 // group)).astype(np.float32)
    got = quant.dequantize(quant.pack(q, bits), s, b, bits, group)
    want = np.repeat(s, group, axis=1) * q.astype(np.float32) + np.repeat(b, group, axis=1)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize(("bits", "group"), PAIRS)
def test_quantize_round_trips_its_own_grid(bits, group):
    w = _matrix(3)
    weight, scales, biases = quant.quantize(w, bits, group)
    assert weight.shape == (40, 256 * bits // 32) and scales.shape == (40, 256 // group)
    assert scales.dtype == biases.dtype == np.float32
    back = quant.dequantize(weight, scales, biases, bits, group)
    step = np.repeat(np.abs(scales), group, axis=1)
    # mlx snaps the scale so the larger edge is exact; the far edge may then clip by < 1 step
    assert (np.abs(back - w) <= step).all()
    assert np.array_equal(back[1], w[1]) and np.array_equal(back[0], w[0])  # constants exact


def test_quantize_refuses_bad_input_in_one_line():
    w = np.zeros((2, 64), np.float32)
    for args, needle in [((w, 3, 64), "3-bit"), ((w, 4, 16), "group size 16"), ((w, 4, 48), "48")]:
        with pytest.raises(ModelError, match=needle) as e:
            quant.quantize(*args)
        assert "\n" not in str(e.value)
    with pytest.raises(ModelError, match="whole groups"):
        quant.quantize(np.zeros((2, 40), np.float32), 4, 32)
    w[0, 0] = np.inf
    with pytest.raises(ModelError, match="inf or nan"):
        quant.quantize(w, 4, 32)


@pytest.fixture(scope="module")
def mx():
    return pytest.importorskip("mlx.core", reason="MLX is not installed: no reference quantizer")


def _mlx_input(mx, w: np.ndarray, dtype: str):
    """(the mlx array, what spill's quantizer gets: float32, float16, or bf16 as uint16 bits)."""
    if dtype == "float32":
        return mx.array(w), w
    if dtype == "float16":
        return mx.array(w.astype(np.float16)), w.astype(np.float16)
    a = mx.array(w).astype(mx.bfloat16)
    return a, np.array(a.view(mx.uint16))


def _bytes(mx, a) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a).view(np.uint8)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize(("bits", "group"), PAIRS)
def test_quantize_equals_mx_quantize_bit_for_bit(mx, bits, group, dtype):
    for seed in range(3):
        a, w = _mlx_input(mx, _matrix(seed), dtype)
        mq, ms, mb = mx.quantize(a, group_size=group, bits=bits)
        q, s, b = quant.quantize(w, bits, group)
        assert np.array_equal(np.array(mq), q)
        assert np.array_equal(_bytes(mx, ms), s.view(np.uint8))
        assert np.array_equal(_bytes(mx, mb), b.view(np.uint8))


@pytest.mark.parametrize(("bits", "group"), PAIRS)
def test_dequantize_equals_mx_dequantize_bit_for_bit(mx, bits, group):
    q, s, b = quant.quantize(_matrix(11), bits, group)
    want = np.array(mx.dequantize(mx.array(q), mx.array(s), mx.array(b), group, bits))
    got = quant.dequantize(q, s, b, bits, group)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _found(weight=("U32", [64, 20]), scales=("BF16", [64, 5]), biases=("BF16", [64, 5])):
    """``check_packed``'s view of a 4-bit g32 (64, 160) module's three header entries."""
    parts = {"weight": weight, "scales": scales, "biases": biases}
    return {
        p: None if v is None else ("m.safetensors", {"dtype": v[0], "shape": v[1]})
        for p, v in parts.items()
    }


@pytest.mark.parametrize(
    "found, words",
    [
        (_found(weight=("U32", [63, 20])), "m.weight is [63, 20], where 4-bit groups of 32"),
        (_found(weight=("U32", [64, 19])), "make [64, 20]"),
        (_found(scales=("BF16", [64, 4])), "m.scales is [64, 4]"),
        (_found(biases=None), "m.biases is missing"),
        (_found(weight=("F32", [64, 160])), "m.weight is F32 beside its own scales and biases"),
        (_found(weight=("F32", [64, 20])), "m.weight is F32 beside its own scales and biases"),
        (_found(scales=("U8", [64, 5])), "m.scales is U8"),
    ],
)
def test_check_packed_names_the_file_and_tensor_in_one_line(found, words):
    with pytest.raises(ModelError) as e:
        quant.check_packed("m", quant.Spec(4, 32), (64, 160), found)
    assert str(e.value).startswith("m.safetensors: ") and words in str(e.value)
    assert "\n" not in str(e.value)


def test_check_packed_takes_the_layout_quantize_writes():
    quant.check_packed("m", quant.Spec(4, 32), (64, 160), _found())
    w, s, b = quant.quantize(_matrix(3, 64, 160), 8, 32)
    entries = {"weight": ("U32", list(w.shape)), "scales": ("F32", list(s.shape))}
    quant.check_packed(
        "m", quant.Spec(8, 32), (64, 160), _found(**entries, biases=("F32", [64, 5]))
    )


def test_finite_reads_bf16_bits_float16_and_float32():
    w = _matrix(4)
    assert quant.finite(w) and quant.finite(w.astype(np.float16)[:3])
    _, s, b = quant.quantize(float32_to_bf16_bits(w), 4, 32)  # bf16 scales, as uint16 bits
    assert s.dtype == np.uint16 and quant.finite(s) and quant.finite(b)
    for bad in (0x7F80, 0xFF80, 0x7FC0, 0x7F81):  # +inf, -inf, NaN, another NaN
        assert not quant.finite(np.array([0x3F80, bad], dtype=np.uint16))
    assert not quant.finite(np.array([1.0, np.nan], np.float32))
    assert not quant.finite(np.array([np.inf], np.float16))
