"""mlx-lm's affine quantized layout: pack, unpack, dequantize and quantize, in numpy.

Per group of ``G`` consecutive values along a row (the input dimension) one scale and one bias: ``w
= scale * q + bias`` with ``q`` in ``[0, 2**bits - 1]``. A matrix ``(out, in)`` is stored as mlx
stores it: ``weight`` uint32 ``(out, in * bits / 32)``, element ``j`` of a word in bits ``j * bits``
upward, ``scales`` and ``biases`` ``(out, in / G)``. A tensor is quantized when its ``.scales``
exist. ``quantize`` gives the same bits as ``mx.quantize``, with or without MLX; ``dequantize``
computes ``scale * q + bias`` in float32.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from spill.errors import ModelError
from spill.settings import BITS, GROUP_SIZES

READ_GROUP_SIZES = (16, *GROUP_SIZES)  # 16 is read too (GGUF Q6_K, see gguf.quant)
_EPS = np.float32(1e-7)  # mlx's floor on a group's scale (a constant group)


@dataclass(frozen=True)
class Spec:
    """One tensor's quantization."""

    bits: int
    group_size: int

    def check(self, where: str) -> None:
        if self.bits not in BITS or self.group_size not in READ_GROUP_SIZES:
            raise ModelError(
                f"{where}: {self.bits}-bit affine with group size {self.group_size} is not "
                f"supported; spill reads bits {'/'.join(map(str, BITS))} with groups "
                f"{'/'.join(map(str, READ_GROUP_SIZES))}"
            )

    # Element ``j`` of a word sits in bits ``j * bits`` upward (little-endian within the word).
    def packed_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        return shape[0], shape[1] * self.bits // 32

    def group_shape(self, shape: tuple[int, int]) -> tuple[int, int]:
        return shape[0], shape[1] // self.group_size


FLOAT_CODES = ("F32", "F16", "BF16")  # what scales and biases may be stored as
Found = tuple[str, dict] | None  # (the file, its safetensors header entry), None: absent
_AGAIN = "the file is damaged or not this config's: quantize, import or fetch the model again"


def check_packed(module: str, spec: Spec, shape: tuple[int, int], found: Mapping[str, Found]):
    """Refuse ``module`` unless its weight, scales and biases (``found``, by part) are one packed
    linear of float shape ``shape`` (out, in): weight U32 ``spec.packed_shape``, scales and
    biases float ``spec.group_shape``. One line naming the file and tensor: a float weight
    beside its own scales and biases is two forms of one module, never silently one of them."""
    for part in ("weight", "scales", "biases"):
        if found.get(part) is None:
            there = next(f for f in found.values() if f is not None)[0]
            raise ModelError(
                f"{there}: {module}.{part} is missing beside its module's other packed tensors; "
                f"{_AGAIN}"
            )
    where, info = found["weight"]
    if info["dtype"] != "U32":
        raise ModelError(
            f"{where}: {module}.weight is {info['dtype']} beside its own scales and biases; a "
            "module is either float (a weight alone) or packed (a U32 weight, scales and "
            f"biases), not both: {_AGAIN}"
        )
    want = {"weight": spec.packed_shape(shape)} | dict.fromkeys(
        ("scales", "biases"), spec.group_shape(shape)
    )
    for part, (where, info) in ((p, found[p]) for p in ("weight", "scales", "biases")):
        if part != "weight" and info["dtype"] not in FLOAT_CODES:
            raise ModelError(
                f"{where}: {module}.{part} is {info['dtype']}; scales and biases are "
                f"{'/'.join(FLOAT_CODES)}: {_AGAIN}"
            )
        if tuple(info["shape"]) != want[part]:
            raise ModelError(
                f"{where}: {module}.{part} is {list(info['shape'])}, where {spec.bits}-bit groups "
                f"of {spec.group_size} over the {list(shape)} linear of config.json make "
                f"{list(want[part])}; {_AGAIN}"
            )


def finite(a: np.ndarray) -> bool:
    """Whether every value of ``a`` (float32, float16, or bfloat16 as its uint16 bits) is
    finite; a bf16's exponent bits all set is inf or NaN."""
    if a.dtype == np.uint16:
        return not ((a & np.uint16(0x7F80)) == np.uint16(0x7F80)).any()
    return bool(np.isfinite(a).all())


def not_finite(where, name: str) -> ModelError:
    """The refusal of a tensor holding inf or NaN (the reader found it as it loaded)."""
    return ModelError(
        f"{where}: {name} holds NaN or inf, so every output computed from it would too; the "
        "model's weights are damaged: quantize, import or fetch it again"
    )


def spec_of(group) -> Spec | None:
    """The spec a settings group asks for (``quantize`` and ``group_size`` of
    ``spill.settings.ModelSettings``); None: the float weights, or a group without them."""
    bits = getattr(group, "quantize", None)
    return None if bits is None else Spec(bits, group.group_size)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """(out, in) integers in ``[0, 2**bits)`` -> uint32 (out, in * bits / 32), low bits first."""
    per = 32 // bits
    rows, cols = q.shape
    words = q.astype(np.uint32).reshape(rows, cols // per, per)
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)  # (per,)
    return np.bitwise_or.reduce(words << shifts, axis=-1)


def unpack(weight: np.ndarray, bits: int) -> np.ndarray:
    """uint32 (out, words) -> uint8 (out, words * 32 / bits)."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    q = (weight[..., None] >> shifts) & np.uint32((1 << bits) - 1)  # (out, words, per)
    return q.astype(np.uint8).reshape(weight.shape[0], -1)


# In float32, which is how every source's exactness is proven.
def dequantize(
    weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int
) -> np.ndarray:
    """float32 (out, in): ``scale * q + bias`` in float32, one scale and bias per group."""
    q = unpack(weight, bits).astype(np.float32)
    rows, cols = q.shape
    if cols != scales.shape[1] * group_size or scales.shape != biases.shape:
        raise ModelError(
            f"packed weight of {cols} columns does not match {scales.shape[1]} groups of "
            f"{group_size}; the quantized tensor is damaged, import or quantize it again"
        )
    q = q.reshape(rows, -1, group_size)  # (out, groups, G)
    s = scales.astype(np.float32)[..., None]
    b = biases.astype(np.float32)[..., None]
    return (s * q + b).reshape(rows, cols)


def _to_float32(w: np.ndarray) -> np.ndarray:
    if w.dtype == np.uint16:  # bf16 bits, as spill's safetensors reader gives them
        return (w.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(w, dtype=np.float32)


def _like(x: np.ndarray, dtype) -> np.ndarray:
    """float32 -> the input's dtype, rounding to nearest even (bf16 kept as uint16 bits)."""
    if dtype == np.uint16:
        bits = x.astype(np.float32).view(np.uint32)
        rounded = bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))
        return (rounded >> 16).astype(np.uint16)
    return x.astype(dtype)


# mlx's affine quantizer (``mx.quantize``), step for step in float32, so it gives the same bits with
# or without MLX: the scale snaps so that the group's larger-magnitude edge is hit exactly; scales
# and biases come back in the input's dtype.
def quantize(
    w: np.ndarray, bits: int, group_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(weight uint32, scales, biases) of ``w`` (out, in), the same bits as ``mx.quantize``.

    ``w`` is float32, float16, or bfloat16 given as its uint16 bits; scales and biases come
    back in that dtype (bf16 again as uint16 bits)."""
    Spec(bits, group_size).check("quantize")
    if group_size not in GROUP_SIZES:
        raise ModelError(
            f"group size {group_size} is not one mlx takes; use {'/'.join(map(str, GROUP_SIZES))}"
        )
    if w.ndim != 2 or w.shape[1] % group_size:
        raise ModelError(
            f"a tensor of shape {w.shape} cannot be quantized in groups of {group_size}; "
            "its rows must split into whole groups"
        )
    rows, cols = w.shape
    x = _to_float32(w).reshape(rows, cols // group_size, group_size)  # (out, groups, G)
    if not np.isfinite(x).all():
        raise ModelError("the tensor holds inf or nan; fix the float model before quantizing it")
    n_bins = np.float32((1 << bits) - 1)
    w_max, w_min = x.max(axis=-1), x.min(axis=-1)  # (out, groups)
    low = np.abs(w_min) > np.abs(w_max)  # the negative edge is the larger one
    scale = np.maximum((w_max - w_min) / n_bins, _EPS)
    scale = np.where(low, scale, -scale)
    edge = np.where(low, w_min, w_max)
    q0 = np.rint(edge / scale)
    snap = q0 != 0  # the edge lands on a whole step: scale it so the edge is exact
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(snap, edge / q0, scale).astype(np.float32)
    bias = np.where(snap, edge, np.float32(0)).astype(np.float32)
    q = np.rint((x - bias[..., None]) / scale[..., None])
    q = np.clip(q, 0, n_bins).astype(np.uint32).reshape(rows, cols)
    return pack(q, bits), _like(scale, w.dtype), _like(bias, w.dtype)


# ``config.json`` says ``"quantization": {"group_size": G, "bits": B}``, plus an entry per module
# path (``"model.layers.0.mlp.down_proj": {...}``) where one differs, as mlx-lm writes mixed
# quantizations.
def config_entry(specs: Mapping[str, Spec]) -> dict:
    """config.json's ``quantization`` for ``{module path: spec}``: the most common spec as the
    default, and an entry for each module that differs (mlx-lm's mixed layout)."""
    counts = Counter(specs.values())
    default = max(counts, key=lambda s: (counts[s], s.bits, s.group_size))
    entry: dict = {"group_size": default.group_size, "bits": default.bits}
    for module, spec in sorted(specs.items()):
        if spec != default:
            entry[module] = {"group_size": spec.group_size, "bits": spec.bits}
    return entry


def module_spec(quantization: Mapping, module: str, where: str) -> Spec:
    """The spec config.json's ``quantization`` gives ``module`` (its own entry, else the default)."""
    entry = quantization.get(module, quantization)
    try:
        spec = Spec(int(entry["bits"]), int(entry["group_size"]))
    except (KeyError, TypeError, ValueError):
        raise ModelError(
            f"{where}: quantization of {module} needs integer bits and group_size; "
            "re-import or re-quantize the model"
        ) from None
    spec.check(where)
    return spec


def exact_float16(*arrays: np.ndarray) -> bool:
    """Whether every value of ``arrays`` (float32) survives a float16 round trip bit for bit."""
    return all(
        np.array_equal(a.astype(np.float16).astype(np.float32).view(np.uint32), a.view(np.uint32))
        for a in arrays
    )


def safetensors_entries(
    module: str, weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, dtype: str
) -> dict[str, tuple[str, np.ndarray]]:
    """``{name: (dtype code, array)}`` of one quantized module for ``safetensors_io.write_file``."""
    return {
        f"{module}.weight": ("U32", weight),
        f"{module}.scales": (dtype, scales),
        f"{module}.biases": (dtype, biases),
    }


def describe(quantization, sources=()) -> str:
    """``4-bit affine g32 from Q4_1/Q8_0, 1 module 8-bit g32`` for ``ModelConfig.quantization``
    (and the GGUF types a kept import came from)."""
    bits, group = next((b, g) for m, b, g in quantization if m == "")
    text = f"{bits}-bit affine g{group}"
    if sources:
        text += " from " + "/".join(sorted(set(sources)))
    others = Counter((b, g) for m, b, g in quantization if m and (b, g) != (bits, group))
    for (b, g), n in sorted(others.items()):
        text += f", {n} module{'s' if n > 1 else ''} {b}-bit g{g}"
    return text
