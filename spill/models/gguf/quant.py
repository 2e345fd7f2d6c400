"""GGUF quantized blocks as spill's affine groups (``spill.models.quant``), without loss
(``to_affine``, ``kept_tensors``, ``file_tag``).

Each supported ggml type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) becomes per-group ``scale
* q + bias`` with the same float32 values that ``gguf.quants.dequantize`` computes. Other types
(Q2_K, Q3_K) are not mapped: ``to_affine`` returns None and the importer dequantizes them. Scales
and biases come back as float32; the importer narrows them to float16 where every value survives.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from spill.models.gguf.reader import GGUFFile, TensorInfo
from spill.models.quant import Spec, exact_float16, pack, safetensors_entries

T = GGMLQuantizationType
FLOAT_TYPES = (T.F32, T.F16, T.BF16)
DTYPE_RULE = (
    "quantized tensors packed as stored (U32 weight, scales and biases F16 where exact, else F32); "
    "per other tensor: BF16 if every value round-trips exactly, else F16 if exact, else F32"
)
# Every product involved is exact in float32 (an fp16 ``d`` has 11 significant bits, a sub-scale at
# most 7, a quant at most 8) and the one rounding left, the final add or subtract, happens on the
# same two numbers:
#   =======  =====  =====  ====================================  ==================================
#   type     bits   group  scale                                 bias
#   =======  =====  =====  ====================================  ==================================
#   Q4_0     4      32     d                                     -8 d
#   Q4_1     4      32     d                                     m
#   Q5_0     8      32     d                                     -16 d
#   Q5_1     8      32     d                                     m
#   Q8_0     8      32     d                                     -128 d   (q = int8 + 128)
#   Q4_K     4      32     f32(d * sc)                           -f32(dmin * m)
#   Q5_K     8      32     f32(d * sc)                           -f32(dmin * m)
#   Q6_K     8      16     f32(d * sc)                           -32 f32(d * sc)
#   =======  =====  =====  ====================================  ==================================
# 5- and 6-bit values are stored in 8 bits (spill packs 4 and 8 only); Q6_K keeps its groups of 16,
# which mlx's kernels do not take.
SPECS = {
    T.Q4_0: Spec(4, 32),
    T.Q4_1: Spec(4, 32),
    T.Q5_0: Spec(8, 32),
    T.Q5_1: Spec(8, 32),
    T.Q8_0: Spec(8, 32),
    T.Q4_K: Spec(4, 32),
    T.Q5_K: Spec(8, 32),
    T.Q6_K: Spec(8, 16),
}


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes per block (n, 2) -> float32 (n, 1)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, k, 32 or 16) bytes -> (n, k, 2 * width): low nibbles first, then high ones."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(word: np.ndarray, count: int) -> np.ndarray:
    """(n, 1) uint32 -> (n, count) uint8: bit i of each word."""
    return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, (n, 8) each."""
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _blocks(blocks: np.ndarray, qtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(n, type_size) bytes -> q (n, block) uint8, scale and bias (n, block / group) float32."""
    n = blocks.shape[0]
    if qtype in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1):
        offset = 4 if qtype in (T.Q4_1, T.Q5_1) else 2
        five = qtype in (T.Q5_0, T.Q5_1)
        qs = blocks[:, offset + 4 * five :]  # (n, 16)
        q = _nibbles(qs)
        if five:
            qh = np.ascontiguousarray(blocks[:, offset : offset + 4]).view("<u4")
            q = q | (_bits(qh, 32) << 4)
        d = _f16(blocks[:, 0:2])
        if offset == 4:
            return q, d, _f16(blocks[:, 2:4])
        return q, d, d * np.float32(-16 if five else -8)
    if qtype == T.Q8_0:
        d = _f16(blocks[:, 0:2])
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return q, d, d * np.float32(-128)
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, mn = _k_scales(blocks[:, 4:16])
        qs = blocks[:, -128:].reshape(n, 4, 32)
        q = _nibbles(qs).reshape(n, 256)  # element 64 c + j: low nibble of byte 32 c + j
        if qtype == T.Q5_K:
            qh = blocks[:, 16:48]  # bit s of byte j is the fifth bit of element 32 s + j
            high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
            q = q | (high.reshape(n, 256) << 4)
        return q, d * sc, -(dmin * mn)
    if qtype == T.Q6_K:
        ql, qh = blocks[:, 0:128].reshape(n, 2, 64), blocks[:, 128:192].reshape(n, 2, 1, 32)
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks[:, 208:210])
        low = _nibbles(ql)  # (n, 2, 128): element 128 h + j
        high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
        q = (low | (high.reshape(n, 2, 128) << 4)).reshape(n, 256)  # q - 32 is ggml's value
        scale = d * sc
        return q, scale, scale * np.float32(-32)
    raise AssertionError(qtype)


def to_affine(
    raw: np.ndarray, qtype, shape: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Spec] | None:
    """A GGUF matrix's bytes (out, bytes per row) -> (q uint8 (out, in), scales, biases
    float32 (out, in / G), spec); None for a type without an exact affine form."""
    spec = SPECS.get(qtype)
    if spec is None:
        return None
    rows, cols = shape
    block, size = GGML_QUANT_SIZES[qtype]
    q, scale, bias = _blocks(raw.reshape(-1, size), qtype)
    groups = cols // spec.group_size
    return (
        q.reshape(rows, cols),
        scale.reshape(rows, groups).astype(np.float32),
        bias.reshape(rows, groups).astype(np.float32),
        spec,
    )


def kept_tensors(
    gguf: GGUFFile,
    info: TensorInfo,
    hf_name: str,
    heads: int,
    unpermute: Callable[[np.ndarray, int], np.ndarray],
    say: Callable[[str], None],
) -> tuple[dict, Spec, dict] | None:
    """One GGUF matrix as packed safetensors entries, its spec and its import record; None for a
    float tensor, or (said in one line) a type without an exact affine form: dequantize it."""
    if info.qtype in FLOAT_TYPES:
        return None
    gguf.check_supported(info)
    mapped = to_affine(gguf.raw(info), info.qtype, info.shape)
    if mapped is None:
        say(f"{info.name}: {info.qtype.name} has no exact affine form; stored dequantized (exact)")
        return None
    q, scales, biases, spec = mapped
    arrays = [pack(q, spec.bits), scales, biases]
    if heads:  # llama.cpp's row interleave: whole rows of all three move together
        arrays = [np.ascontiguousarray(unpermute(a, heads)) for a in arrays]
    dtype = "F16" if exact_float16(arrays[1], arrays[2]) else "F32"
    module = hf_name.removesuffix(".weight")
    entries = safetensors_entries(module, arrays[0], *arrays[1:], dtype)
    record = {
        "gguf": info.name,
        "ggml_type": info.qtype.name,
        "dtype": "U32",
        "bits": spec.bits,
        "group_size": spec.group_size,
        "scales": dtype,
    }
    return entries, spec, record


def file_tag(gguf: GGUFFile) -> str:
    """The file's quantization as a name tag: its most common mapped type (``q4_1``)."""
    kinds = [t.qtype for t in gguf.tensors if t.qtype in SPECS and len(t.shape) == 2]
    if not kinds:
        return "f"
    return max(set(kinds), key=lambda k: (kinds.count(k), k.name)).name.lower()
