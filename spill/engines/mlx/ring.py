"""The streaming ring for MLX: decoder layers come from local safetensors into K slots.

Same contract as the torch engine's ring: ``Ring.walk(order)`` yields ``(index, weights)`` in any
order, a prefetch thread loads up to K-1 layers ahead, K permits bound the layers alive, and a
slot is cleared when the walk moves past it. Resident mode loads every layer once.

MLX streams are per thread (an op built on the loader thread cannot be evaluated on the main
one), so the loader only builds arrays from host memory: bytes are read with ``preadv`` into a
reused numpy staging buffer, converted there (bf16 bits -> float32 is a shift, exact), and copied
into ``mx.array``. bf16 compute keeps the bits as uint16, and the walking thread bit-casts them
(``view``, no copy). Streamed and resident runs read the same bytes the same way, so they agree
bit for bit. Memory comes from MLX's allocator, whose cache reuses a released slot's buffers.
``plan_ring`` is shared with the torch engine (``spill.engines.common``).
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from spill.engines.base import Stats
from spill.engines.common import plan_ring as plan_ring  # re-exported
from spill.engines.common import tensor_spans
from spill.errors import EngineError, ModelError
from spill.models.safetensors_io import float32_to_bf16_bits
from spill.models.weights import WeightFiles

MAX_IOV = 512  # contiguous tensors per read
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
    """Tensors by HF name from a folder's shards, as MLX arrays in the compute dtype.

    Reads use ``preadv`` on file descriptors, never a long-lived mmap (a mapped shard's touched
    pages would count toward the process's RSS, weighing the whole model however small the ring).
    """

    def __init__(self, files: WeightFiles, dtype: mx.Dtype):
        if dtype not in (mx.float32, mx.bfloat16):
            raise EngineError(f"compute dtype {dtype} is not supported; use float32 or bfloat16")
        self.files, self.dtype = files, dtype
        self._fds: dict[str, tuple[int, int]] = {}  # shard -> (fd, start of tensor data)
        self._lock = threading.Lock()
        self._staging = np.empty(0, dtype=np.uint8)  # bytes as read
        self._converted = np.empty(0, dtype=np.uint8)  # one tensor in the compute dtype

    def has(self, name: str) -> bool:
        return name in self.files.tensor_shard

    def _fd(self, shard: str) -> tuple[int, int]:
        if shard not in self._fds:
            fd = os.open(self.files.folder / shard, os.O_RDONLY)
            header = os.pread(fd, 8, 0)
            self._fds[shard] = (fd, 8 + struct.unpack("<Q", header)[0])
        return self._fds[shard]

    def _pread(self, fd: int, buf: np.ndarray, offset: int, shard: str) -> None:
        """Fill ``buf`` from ``offset``; loops on short reads (Linux caps one call at ~2 GiB)."""
        view, done = memoryview(buf).cast("B"), 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise ModelError(
                    f"{self.files.folder / shard}: short read at byte {offset + done}; the file "
                    "changed under spill, fetch the model again"
                )
            done += n

    def tensor(self, name: str) -> mx.array:
        return finish(self.tensors([name]))[name]

    def tensors(self, names) -> dict[str, mx.array]:
        """Several tensors, read in file order, one read per contiguous byte range (a decoder
        layer is usually one). bf16 compute returns uint16 bits: pass them through ``finish``."""
        spans = tensor_spans(self.files, names, _NUMPY)  # (shard, start, end, name)
        bf16 = self.dtype == mx.bfloat16
        out: dict[str, mx.array] = {}
        with self._lock:
            i = 0
            while i < len(spans):
                shard, lo, hi, _ = spans[i]
                j = i + 1
                while j < len(spans) and j - i < MAX_IOV and spans[j][:2] == (shard, hi):
                    hi = spans[j][2]
                    j += 1
                fd, base = self._fd(shard)
                if self._staging.nbytes < hi - lo:
                    self._staging = np.empty(hi - lo, dtype=np.uint8)
                raw = self._staging[: hi - lo]
                self._pread(fd, raw, base + lo, shard)
                for _, t_lo, t_hi, name in spans[i:j]:
                    info = self.files.headers[shard][name]
                    need = 4 * int(np.prod(info["shape"], dtype=np.int64))
                    if self._converted.nbytes < need:
                        self._converted = np.empty(need, dtype=np.uint8)
                    data = _convert(
                        raw[t_lo - lo : t_hi - lo], info["dtype"], bf16, self._converted
                    )
                    # mx.array copies out of the staging buffers, into memory MLX's allocator
                    # recycles from released slots (no fresh pages, no page faults)
                    out[name] = mx.array(data.reshape(info["shape"]))
                i = j
        return out

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._staging = self._converted = np.empty(0, dtype=np.uint8)


class Ring:
    """K slots of decoder layers over a loader ``load(i) -> {key: array}``."""

    def __init__(
        self,
        load: Callable[[int], dict[str, mx.array]],
        layers: int,
        slots: int,
        resident: bool,
        stats: Stats,
    ):
        assert slots >= 1
        self._load_fn, self.layers, self.slots, self.resident = load, layers, slots, resident
        self.stats = stats
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self.max_live = 0
        self.wait_seconds = 0.0  # time the walk waited on the loader
        self._resident: list[dict[str, mx.array]] = []
        if resident:
            self._resident = [finish(self._load(i)) for i in range(layers)]
            mx.eval([v for w in self._resident for v in w.values()])

    def live(self) -> set[int]:
        """Indices of the layers loaded right now."""
        with self._lock:
            return set(self._live)

    def _load(self, i: int) -> dict[str, mx.array]:
        t = time.perf_counter()
        w = self._load_fn(i)
        with self._lock:
            self._live.add(i)
            self.max_live = max(self.max_live, len(self._live))
            self.stats.layer_loads += 1
            self.stats.load_seconds += time.perf_counter() - t
        return w

    def _release(self, i: int, w: dict) -> None:
        w.clear()
        with self._lock:
            self._live.discard(i)

    def walk(self, order: Sequence[int]) -> Iterator[tuple[int, dict[str, mx.array]]]:
        """Yield ``(i, weights)`` for each layer in ``order``; weights live until the next step,
        so the caller evaluates what it computed from them before moving on."""
        order = list(order)
        if self.resident:
            for i in order:
                yield i, self._resident[i]
            return
        permits = threading.Semaphore(self.slots)
        ready: queue.Queue = queue.Queue()
        stop = threading.Event()

        def prefetch():
            for i in order:
                permits.acquire()
                if stop.is_set():
                    return
                try:
                    ready.put((i, self._load(i), None))
                except BaseException as e:  # handed to the walk, which raises it
                    ready.put((i, None, e))
                    return

        loader = threading.Thread(target=prefetch, name="spill-ring", daemon=True)
        loader.start()
        try:
            for _ in order:
                t = time.perf_counter()
                i, w, error = ready.get()
                self.wait_seconds += time.perf_counter() - t
                if error is not None:
                    raise error
                try:
                    yield i, finish(w)
                finally:
                    self._release(i, w)
                    permits.release()
        finally:
            stop.set()
            for _ in order:
                permits.release()  # the loader never blocks again
            loader.join()
            while not ready.empty():
                i, w, _ = ready.get()
                if w is not None:
                    self._release(i, w)

    def close(self) -> None:
        for w in self._resident:
            w.clear()
        self._resident = []
