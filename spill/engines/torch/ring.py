"""The streaming ring: decoder layers come from local safetensors into K slots, just in time.

``Ring.walk(order)`` yields ``(index, weights)`` for the layers in any order (forward now,
reversed for a backward pass). A prefetch thread loads up to K-1 layers ahead of the one being
computed; K semaphore permits bound how many layers are alive at once, and a layer's slot is
released (its dict cleared) when the walk moves past it, so weights are valid only until the
next step. In resident mode every layer is loaded once and the walk only looks them up.

Both modes hand the compute code the same tensors (read from the same bytes, converted the same
way), which is what makes streamed and resident runs bit-identical.
"""

from __future__ import annotations

import os
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from spill.engines.base import Stats
from spill.engines.common import plan_ring as plan_ring  # re-exported
from spill.engines.common import tensor_spans
from spill.errors import ModelError
from spill.models.weights import WeightFiles

MAX_IOV = 512  # buffers per preadv call (IOV_MAX is 1024 on Linux and macOS)
RESIDENT_FRACTION = 0.5  # default budget: this share of the memory available on the device


def default_budget(device: torch.device) -> int:
    """Half the memory available on ``device`` right now."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * RESIDENT_FRACTION)
    import psutil

    return int(psutil.virtual_memory().available * RESIDENT_FRACTION)


_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "U8": torch.uint8,
}


def _as(raw: torch.Tensor, info: dict) -> torch.Tensor:
    """A tensor over ``raw``'s bytes with the header's dtype and shape."""
    dtype = _DTYPES[info["dtype"]]
    if raw.storage_offset() % dtype.itemsize:  # a file that does not align its tensors
        raw = raw.clone()
    return raw.view(dtype).reshape(info["shape"])


class WeightReader:
    """Tensors by HF name from a folder's shards, on ``device`` in the compute dtype.

    Tensors are read with ``pread`` into memory torch owns, never through a long-lived mmap: a
    mapped shard's touched pages count toward the process's resident set until it is unmapped,
    so a model read through one would weigh its whole size in RSS however small the ring.
    On a CPU the bytes land in one reused staging buffer and are copied into tensors recycled
    from released ring slots: fresh memory costs a page fault per 4 KiB, which on this kind of
    machine cut a warm read from ~11 GB/s to ~2 GB/s.
    """

    def __init__(self, files: WeightFiles, device: torch.device, dtype: torch.dtype):
        self.files, self.device, self.dtype = files, device, dtype
        self._fds: dict[str, tuple[int, int]] = {}  # shard -> (fd, start of tensor data)
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._pool: dict[tuple, list[torch.Tensor]] = {}  # (shape, dtype) -> free tensors
        self._pooling = device.type == "cpu"

    def recycle(self, tensors) -> None:
        """Take back a released slot's tensors for the next load (CPU only; CUDA's caching
        allocator already reuses device memory)."""
        if not self._pooling:
            return
        with self._lock:
            for t in tensors:
                self._pool.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def _output(self, shape: tuple) -> torch.Tensor:
        with self._lock:
            free = self._pool.get((shape, self.dtype))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=self.dtype)

    def _pread(self, fd: int, buffers: list, offset: int, nbytes: int, shard: str) -> None:
        """Fill ``buffers`` from ``offset``; loops on short reads (Linux returns at most ~2 GiB
        per call, so a 4 GiB embedding takes several)."""
        views = [memoryview(b).cast("B") for b in buffers if b.nbytes]
        done = 0
        while views:
            n = os.preadv(fd, views, offset + done)
            if n <= 0:
                raise ModelError(
                    f"{self.files.folder / shard}: short read at byte {offset + done}; the file "
                    "changed under spill, fetch the model again"
                )
            done += n
            while views and n >= len(views[0]):
                n -= len(views.pop(0))
            if views and n:
                views[0] = views[0][n:]
        assert done == nbytes

    def has(self, name: str) -> bool:
        return name in self.files.tensor_shard

    def _fd(self, shard: str) -> tuple[int, int]:
        with self._lock:
            if shard not in self._fds:
                path = self.files.folder / shard
                fd = os.open(path, os.O_RDONLY)
                header = os.pread(fd, 8, 0)
                self._fds[shard] = (fd, 8 + struct.unpack("<Q", header)[0])
            return self._fds[shard]

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors([name])[name]

    def tensors(self, names) -> dict[str, torch.Tensor]:
        """Several tensors, read in file order with one ``pread`` per contiguous byte range
        (a decoder layer is usually one range): the disk sees a sequential read."""
        spans = tensor_spans(self.files, names, _DTYPES)  # (shard, start, end, name)
        out: dict[str, torch.Tensor] = {}
        i = 0
        while i < len(spans):
            shard, lo, hi, _ = spans[i]
            j = i + 1
            while j < len(spans) and j - i < MAX_IOV and spans[j][0] == shard and spans[j][1] == hi:
                hi = spans[j][2]
                j += 1
            fd, base = self._fd(shard)
            group = spans[i:j]
            infos = [self.files.headers[shard][name] for *_, name in group]
            if self._pooling and all(_DTYPES[f["dtype"]] == self.dtype for f in infos):
                # Same dtype on a CPU: scatter the range straight into the output tensors.
                outs = [self._output(tuple(f["shape"])) for f in infos]
                views = [o.reshape(-1).view(torch.uint8).numpy() for o in outs]
                self._pread(fd, views, base + lo, hi - lo, shard)
                out.update({name: o for (*_, name), o in zip(group, outs, strict=True)})
                i = j
                continue
            if not self._pooling:
                raw = torch.empty(hi - lo, dtype=torch.uint8)
                self._pread(fd, [raw.numpy()], base + lo, hi - lo, shard)
                for (_, t_lo, t_hi, name), info in zip(group, infos, strict=True):
                    # Move first, then convert: bf16 files cross to a GPU at half the bytes.
                    t = _as(raw[t_lo - lo : t_hi - lo], info)
                    out[name] = t.to(self.device).to(self.dtype).contiguous()
                i = j
                continue
            # A CPU converting dtypes: one tensor at a time through a staging buffer the size
            # of the largest tensor, still in file order.
            with self._read_lock:
                for (_, t_lo, t_hi, name), info in zip(group, infos, strict=True):
                    if self._staging.numel() < t_hi - t_lo:
                        self._staging = torch.empty(t_hi - t_lo, dtype=torch.uint8)
                    raw = self._staging[: t_hi - t_lo]
                    self._pread(fd, [raw.numpy()], base + t_lo, t_hi - t_lo, shard)
                    out[name] = self._output(tuple(info["shape"])).copy_(_as(raw, info))
            i = j
        return out

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._pool.clear()
            self._staging = torch.empty(0, dtype=torch.uint8)


class Ring:
    """K slots of decoder layers over a loader ``load(i) -> {key: tensor}``."""

    def __init__(
        self,
        load: Callable[[int], dict[str, torch.Tensor]],
        layers: int,
        slots: int,
        resident: bool,
        stats: Stats,
        device: torch.device,
        recycle: Callable[[list[torch.Tensor]], None] | None = None,
    ):
        assert slots >= 1
        self._load_fn, self.layers, self.slots, self.resident = load, layers, slots, resident
        self._recycle = recycle
        self.stats = stats
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self.max_live = 0
        self.wait_seconds = 0.0  # time the walk waited on the loader
        # A side stream lets CUDA copies overlap compute on the default stream.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" and not resident else None
        self._resident: list[dict[str, torch.Tensor]] = []
        if resident:
            self._resident = [self._load(i) for i in range(layers)]

    def live(self) -> set[int]:
        """Indices of the layers loaded right now."""
        with self._lock:
            return set(self._live)

    def _load(self, i: int) -> dict[str, torch.Tensor]:
        t = time.perf_counter()
        if self._stream is None:
            w = self._load_fn(i)
        else:
            with torch.cuda.stream(self._stream):
                w = self._load_fn(i)
            self._stream.synchronize()  # blocks the loader thread only
        with self._lock:
            self._live.add(i)
            self.max_live = max(self.max_live, len(self._live))
            self.stats.layer_loads += 1
            self.stats.load_seconds += time.perf_counter() - t
        return w

    def _release(self, i: int, w: dict) -> None:
        if self._recycle is not None:
            self._recycle(list(w.values()))
        w.clear()
        with self._lock:
            self._live.discard(i)

    def walk(self, order: Sequence[int]) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """Yield ``(i, weights)`` for each layer in ``order``; weights live until the next step."""
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
                if self._stream is not None:
                    current = torch.cuda.current_stream(self._stream.device)
                    for tensor in w.values():
                        tensor.record_stream(current)  # freed only after compute used it
                try:
                    yield i, w
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
