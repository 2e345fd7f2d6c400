"""Positioned reads of a model folder's safetensors shards, for every engine's weight reader.

``ShardFiles`` reads tensors with ``preadv`` into caller-owned buffers, never through a long-lived
mmap, a layer's tensors in file order, one read per contiguous byte range (``Range``); ``map`` gives
one range a mapping of its own, unmapped with its last view. What the bytes become (torch tensors,
MLX arrays) is the engine's reader's business. Under a memory budget (``drop``: ``--memory``, or a
cgroup's limit, ``core.budget``) reads leave nothing behind in the page cache.
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
from bisect import bisect_left, bisect_right
from collections.abc import Container, Iterator
from dataclasses import dataclass

from spill.engines.core.common import tensor_spans
from spill.errors import ModelError
from spill.models.weights import WeightFiles

MAX_IOV = 512  # buffers per preadv call (IOV_MAX is 1024 on Linux and macOS)
RESIDENT_FRACTION = 0.5  # an engine's default budget: this share of the memory available now


@dataclass(frozen=True)
class Range:
    """One contiguous byte range of a shard and the tensors in it, in file order."""

    shard: str
    fd: int
    start: int  # absolute file offset of the range's first byte
    nbytes: int
    tensors: list[tuple[int, int, str, dict]]  # (start, end) relative to the range, name, header


# No long-lived mmap: a mapped shard's touched pages count toward the process's resident set until
# it is unmapped, so a model read through one would weigh its whole size in RSS however small the
# ring. Reading in file order, one read per contiguous byte range (a decoder layer is usually one),
# the disk sees a sequential read.
class ShardFiles:
    """Open shards of one model folder and ``pread`` into caller-owned buffers."""

    def __init__(self, files: WeightFiles):
        self.files = files
        self._fds: dict[str, tuple[int, int]] = {}  # shard -> (fd, start of tensor data)
        self._lock = threading.Lock()
        self.bytes_read = 0  # tensor bytes read or mapped so far (a benchmark's per-pass count)
        self.drop = False  # leave no read range in the page cache (a memory budget is in force)
        # fd -> the disjoint runs [start, end) read, as sorted starts and ends: an expert-granular
        # read (an MoE's) adds thousands, and a walk over them all at every read took a third
        # of a batch-8 decode step (profiled: bench/moe.py under py-spy)
        self._runs: dict[int, tuple[list[int], list[int]]] = {}

    def has(self, name: str) -> bool:
        return name in self.files.tensor_shard

    def _fd(self, shard: str) -> tuple[int, int]:
        with self._lock:
            if shard not in self._fds:
                fd = os.open(self.files.folder / shard, os.O_RDONLY)
                header = os.pread(fd, 8, 0)
                self._fds[shard] = (fd, 8 + struct.unpack("<Q", header)[0])
            return self._fds[shard]

    def ranges(self, names, dtypes: Container[str]) -> Iterator[Range]:
        """The byte ranges holding ``names``; raises for a missing tensor or one whose dtype is
        not in ``dtypes``."""
        spans = tensor_spans(self.files, names, dtypes)  # (shard, start, end, name), sorted
        i = 0
        while i < len(spans):
            shard, lo, hi, _ = spans[i]
            j = i + 1
            while j < len(spans) and j - i < MAX_IOV and spans[j][:2] == (shard, hi):
                hi = spans[j][2]
                j += 1
            fd, base = self._fd(shard)
            headers = self.files.headers[shard]
            group = [(a - lo, b - lo, name, headers[name]) for _, a, b, name in spans[i:j]]
            yield Range(shard, fd, base + lo, hi - lo, group)
            i = j

    # For a ring slot on a CPU that computes in the file's dtype, a mapping saves the copy (a warm
    # 14 MB layer: ~0.5 ms mapped vs ~2.2 ms read, measured here).
    def map(self, r: Range) -> memoryview:
        """The range's bytes as a read-only view of the page cache (``mmap``, its pages mapped
        at once): no copy. The mapping lives exactly as long as the last view of it, so a
        streamed layer weighs in RSS only while a ring slot holds it."""
        lo = r.start - r.start % mmap.ALLOCATIONGRANULARITY
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        m = mmap.mmap(r.fd, r.nbytes + r.start - lo, flags=flags, prot=mmap.PROT_READ, offset=lo)
        with self._lock:
            self.bytes_read += r.nbytes
        self._forget(r.fd, r.start, r.nbytes)
        return memoryview(m)[r.start - lo :]

    # Under a budget, after each read ``posix_fadvise(DONTNEED)`` covers the whole run of bytes read
    # so far that the new range joins, not the range alone. The kernel drops only the cached folios
    # a call covers whole, and readahead builds large folios (up to its window, 8 MiB on this
    # machine's disk) that straddle a layer's edges: dropping each range alone left 75% of a
    # streamed model cached, the run left none but the window past the last read. A mapped page is
    # never dropped, so a ring slot's mapped layer stays until it is unmapped, and the next read's
    # call takes it; a copied one (resident parts, held layers) is the copy's business. Without this
    # the cache would keep every layer the ring has finished with, charged to the process's cgroup,
    # until the kernel reclaims it at the limit; a repeated read (a decode step streams the model
    # again) then comes from the disk, which is the price of the promise.
    def _forget(self, fd: int, start: int, nbytes: int) -> None:
        """Under ``drop``: record ``[start, start + nbytes)`` as read and drop the cached pages
        of the run of read bytes it joins (see the comment above)."""
        if not self.drop or not hasattr(os, "posix_fadvise"):  # macOS: no fadvise
            return
        with self._lock:
            starts, ends = self._runs.setdefault(fd, ([], []))
            lo, hi = start, start + nbytes
            i, j = bisect_left(ends, lo), bisect_right(starts, hi)  # runs i..j-1 touch it
            if i < j:
                lo, hi = min(lo, starts[i]), max(hi, ends[j - 1])
            starts[i:j], ends[i:j] = [lo], [hi]
        os.posix_fadvise(fd, lo, hi - lo, os.POSIX_FADV_DONTNEED)

    def pread(self, fd: int, buffers: list, offset: int, shard: str) -> None:
        """Fill ``buffers`` (anything with the buffer protocol) from ``offset``; loops on short
        reads (Linux returns at most ~2 GiB per call, so a 4 GiB embedding takes several)."""
        views = [memoryview(b).cast("B") for b in buffers if b.nbytes]
        with self._lock:
            self.bytes_read += sum(len(v) for v in views)
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
        self._forget(fd, offset, done)

    def close(self) -> None:
        with self._lock:
            for fd, _ in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._runs.clear()
