"""Layers from local safetensors into MLX arrays (``WeightReader``), and what the ring does around a
load (``MLXHooks``).

Bytes are read through ``core.reader.ShardFiles`` and copied into ``mx.array`` in the compute dtype;
streamed and resident runs read the same bytes the same way, so they agree bit for bit. A packed
(quantized) weight stays packed, as an ``ops.Packed`` under the weight's name. A load refuses
scales, biases and 1-D tensors (norms, linear biases) that hold inf or NaN, the first time each is
read in the process, as the torch engine's reader does.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from spill.engines.core.reader import RESIDENT_FRACTION, ShardFiles
from spill.engines.core.ring import Hooks
from spill.engines.mlx.ops import Packed
from spill.errors import EngineError
from spill.models import quant
from spill.models.weights import WeightFiles
from spill.store.safetensors_io import float32_to_bf16_bits

_NUMPY = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,
}
_PACKED = {**_NUMPY, "U32": np.uint32, "BF16": np.uint16}  # scales/biases kept as stored
# A packed weight's uint32 words, scales and biases are read as stored into an ``ops.Packed``, and
# the families multiply it with ``mx.quantized_matmul``, or dequantized per use on a CPU for many
# rows (``dense_rows``, see ``ops``). mlx's kernels take groups of 32, 64 and 128 only, so a
# group-16 tensor (GGUF Q6_K) is dequantized on load, ``scale * q + bias`` in float32 as
# ``models.quant`` and the torch engine compute it, then held in the compute dtype (``dequantized``
# names them).
MLX_GROUPS = quant.GROUP_SIZES  # what mx.quantized_matmul takes


def default_budget() -> int:
    """Half the memory available right now (Apple silicon's GPU shares it)."""
    import psutil

    return int(psutil.virtual_memory().available * RESIDENT_FRACTION)


# MLX streams are per thread (an op built on the loader thread cannot be evaluated on the main one),
# so the loader only builds arrays from host memory: bytes are read through
# ``core.reader.ShardFiles`` (``preadv``, never a long-lived mmap) into a reused numpy staging
# buffer, converted there (bf16 bits -> float32 is a shift, exact), and copied into ``mx.array``.
# bf16 compute keeps the bits as uint16, and ``MLXHooks.ready`` bit-casts them on the computing
# thread (``view``, no copy). Memory comes from MLX's allocator, whose cache reuses a released
# slot's buffers.
def _convert(raw: np.ndarray, code: str, bf16: bool, out: np.ndarray) -> np.ndarray:
    """A tensor's bytes as numpy in the compute dtype (float32, or bf16 bits as uint16); a
    conversion writes into ``out`` (a reused byte buffer) instead of fresh memory."""
    if code not in ("F32", "F16", "BF16", "F64"):
        return raw.view(_NUMPY[code])
    if bf16:
        if code == "BF16":
            return raw.view(np.uint16)
        return float32_to_bf16_bits(raw.view(_NUMPY[code]).astype(np.float32))
    if code == "F32":
        return raw.view(np.float32)
    n = raw.nbytes // np.dtype(_NUMPY[code]).itemsize
    dst = out[: 4 * n].view(np.uint32)
    if code == "BF16":  # bf16 bits are the top half of a float32's: a shift, exact
        np.left_shift(raw.view(np.uint16), 16, out=dst, dtype=np.uint32)
    else:
        np.copyto(dst.view(np.float32), raw.view(_NUMPY[code]), casting="same_kind")
    return dst.view(np.float32)


def _bf16(a: mx.array) -> mx.array:
    return a.view(mx.bfloat16) if a.dtype == mx.uint16 else a


def finish(w: dict) -> dict:
    """On the computing thread, in place: bf16 bits (uint16) become bf16 arrays (a bit-cast),
    a packed weight's scales and biases too."""
    for k, v in w.items():
        if isinstance(v, Packed):
            v.scales, v.biases = _bf16(v.scales), _bf16(v.biases)
        else:
            w[k] = _bf16(v)
    return w


def arrays(w: dict) -> list[mx.array]:
    """Every array of a weight dict, a packed weight's three included (for ``mx.eval``)."""
    return [a for v in w.values() for a in (v.arrays() if isinstance(v, Packed) else [v])]


class WeightReader:
    """Tensors by HF name from a folder's shards, as MLX arrays in the compute dtype; a packed
    weight (``quantized``: name -> (bits, group_size)) as an ``ops.Packed`` that multiplies
    ``dense_rows`` rows or more dequantized (None: always ``quantized_matmul``)."""

    def __init__(
        self,
        files: WeightFiles,
        dtype: mx.Dtype,
        quantized: dict[str, tuple[int, int]] | None = None,
        dense_rows: int | None = None,
    ):
        if dtype not in (mx.float32, mx.bfloat16):
            raise EngineError(f"compute dtype {dtype} is not supported; use float32 or bfloat16")
        self.files, self.dtype = files, dtype
        self.quantized = dict(quantized or {})
        self.dense_rows = dense_rows
        # group 16 has no mlx kernel: those weights are dequantized as they load
        self.dequantized = sorted(n for n, (_, g) in self.quantized.items() if g not in MLX_GROUPS)
        self._shards = ShardFiles(files)
        self._lock = threading.Lock()
        self._staging = np.empty(0, dtype=np.uint8)  # bytes as read
        self._converted = np.empty(0, dtype=np.uint8)  # one tensor in the compute dtype
        self._checked: set[str] = set()  # tensors found finite (``_check_finite``)

    @property
    def bytes_read(self) -> int:
        """Bytes of tensor data read so far (benchmarks count a pass with it)."""
        return self._shards.bytes_read

    def drop_behind(self) -> None:
        """Leave no read range in the page cache (a memory budget is in force: ``core.reader``)."""
        self._shards.drop = True

    def has(self, name: str) -> bool:
        return self._shards.has(name)

    def tensor(self, name: str) -> mx.array:
        return finish(self.tensors([name]))[name]

    def tensors(self, names) -> dict:
        """Several tensors, one read per contiguous byte range. bf16 compute returns uint16
        bits: pass them through ``finish``."""
        names = list(names)
        packed = [n for n in names if n in self.quantized]
        out = self._floats([n for n in names if n not in self.quantized])
        if packed:
            out.update(self._packed(packed))
        return out

    def _packed(self, names) -> dict:
        """Packed weights with their scales and biases, as stored (one read per range)."""
        modules = [n.removesuffix(".weight") for n in names]
        parts = [f"{m}.{p}" for m in modules for p in ("weight", "scales", "biases")]
        raw: dict[str, np.ndarray] = {}
        for r in self._shards.ranges(parts, _PACKED):
            buf = np.empty(r.nbytes, dtype=np.uint8)
            self._shards.pread(r.fd, [buf], r.start, r.shard)
            for lo, hi, name, info in r.tensors:
                raw[name] = buf[lo:hi].copy().view(_PACKED[info["dtype"]]).reshape(info["shape"])
                if not name.endswith(".weight"):  # scales, biases: small, checked every load
                    self._check_finite(name, raw[name])
        out = {}
        for name, m in zip(names, modules, strict=True):
            bits, group = self.quantized[name]
            w, s, b = raw[f"{m}.weight"], raw[f"{m}.scales"], raw[f"{m}.biases"]
            if group not in MLX_GROUPS:
                f32 = quant.dequantize(w, _float32(s), _float32(b), bits, group)  # (out, in)
                if self.dtype == mx.bfloat16:
                    out[name] = mx.array(float32_to_bf16_bits(f32))
                else:
                    out[name] = mx.array(f32)
                continue
            parts = mx.array(w), mx.array(s), mx.array(b)
            out[name] = Packed(*parts, bits, group, self.dtype, self.dense_rows)
        return out

    def _floats(self, names) -> dict[str, mx.array]:
        bf16 = self.dtype == mx.bfloat16
        out: dict[str, mx.array] = {}
        if not names:
            return out
        with self._lock:
            for r in self._shards.ranges(names, _NUMPY):
                if self._staging.nbytes < r.nbytes:
                    self._staging = np.empty(r.nbytes, dtype=np.uint8)
                raw = self._staging[: r.nbytes]
                self._shards.pread(r.fd, [raw], r.start, r.shard)
                for lo, hi, name, info in r.tensors:
                    need = 4 * int(np.prod(info["shape"], dtype=np.int64))
                    if self._converted.nbytes < need:
                        self._converted = np.empty(need, dtype=np.uint8)
                    data = _convert(raw[lo:hi], info["dtype"], bf16, self._converted)
                    if len(info["shape"]) == 1:  # norms, biases: small, checked every load
                        self._check_finite(name, data)
                    # mx.array copies out of the staging buffers, into memory MLX's allocator
                    # recycles from released slots (no fresh pages, no page faults)
                    out[name] = mx.array(data.reshape(info["shape"]))
        return out

    def _check_finite(self, name: str, a: np.ndarray) -> None:
        """Refuse a small tensor holding inf or NaN, the first time the process reads it."""
        if name in self._checked:
            return
        if not quant.finite(a):
            raise quant.not_finite(self.files.folder / self.files.tensor_shard[name], name)
        self._checked.add(name)

    def close(self) -> None:
        self._shards.close()
        with self._lock:
            self._staging = self._converted = np.empty(0, dtype=np.uint8)


def _float32(a: np.ndarray) -> np.ndarray:
    """Stored scales or biases (float16, float32, or bf16 as uint16 bits) as float32, exactly."""
    if a.dtype == np.uint16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32)


class MLXHooks(Hooks):
    """A slot becomes computable on the walking thread: bf16 bits are bit-cast, and the arrays
    evaluated there (MLX streams are per thread)."""

    def ready(self, w):
        finish(w)
        mx.eval(arrays(w))
        return w
