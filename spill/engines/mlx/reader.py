"""Layers from local safetensors into MLX arrays, and what the ring does around a load.

MLX streams are per thread (an op built on the loader thread cannot be evaluated on the main
one), so the loader only builds arrays from host memory: bytes are read through
``core.reader.ShardFiles`` (``preadv``, never a long-lived mmap) into a reused numpy staging
buffer, converted there (bf16 bits -> float32 is a shift, exact), and copied into ``mx.array``.
bf16 compute keeps the bits as uint16, and ``MLXHooks.ready`` bit-casts them on the computing
thread (``view``, no copy). Streamed and resident runs read the same bytes the same way, so they
agree bit for bit. Memory comes from MLX's allocator, whose cache reuses a released slot's
buffers.
"""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from spill.engines.core.reader import ShardFiles
from spill.engines.core.ring import Hooks
from spill.errors import EngineError
from spill.models.weights import WeightFiles
from spill.store.safetensors_io import float32_to_bf16_bits

RESIDENT_FRACTION = 0.5  # default budget: this share of the memory available right now

_NUMPY = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,
}


def default_budget() -> int:
    """Half the memory available right now (Apple silicon's GPU shares it)."""
    import psutil

    return int(psutil.virtual_memory().available * RESIDENT_FRACTION)


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


def finish(w: dict[str, mx.array]) -> dict[str, mx.array]:
    """On the computing thread, in place: bf16 bits (uint16) become bf16 arrays (a bit-cast)."""
    for k, v in w.items():
        if v.dtype == mx.uint16:
            w[k] = v.view(mx.bfloat16)
    return w


class WeightReader:
    """Tensors by HF name from a folder's shards, as MLX arrays in the compute dtype."""

    def __init__(self, files: WeightFiles, dtype: mx.Dtype):
        if dtype not in (mx.float32, mx.bfloat16):
            raise EngineError(f"compute dtype {dtype} is not supported; use float32 or bfloat16")
        self.files, self.dtype = files, dtype
        self._shards = ShardFiles(files)
        self._lock = threading.Lock()
        self._staging = np.empty(0, dtype=np.uint8)  # bytes as read
        self._converted = np.empty(0, dtype=np.uint8)  # one tensor in the compute dtype

    def has(self, name: str) -> bool:
        return self._shards.has(name)

    def tensor(self, name: str) -> mx.array:
        return finish(self.tensors([name]))[name]

    def tensors(self, names) -> dict[str, mx.array]:
        """Several tensors, one read per contiguous byte range. bf16 compute returns uint16
        bits: pass them through ``finish``."""
        bf16 = self.dtype == mx.bfloat16
        out: dict[str, mx.array] = {}
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
                    # mx.array copies out of the staging buffers, into memory MLX's allocator
                    # recycles from released slots (no fresh pages, no page faults)
                    out[name] = mx.array(data.reshape(info["shape"]))
        return out

    def close(self) -> None:
        self._shards.close()
        with self._lock:
            self._staging = self._converted = np.empty(0, dtype=np.uint8)


class MLXHooks(Hooks):
    """A slot becomes computable on the walking thread: bf16 bits are bit-cast, and the arrays
    evaluated there (MLX streams are per thread)."""

    def ready(self, w):
        finish(w)
        mx.eval(list(w.values()))
        return w
