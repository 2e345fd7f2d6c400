"""Layers from local safetensors into torch memory (``WeightReader``), and what the ring does around
a load (``TorchHooks``).

A packed (quantized) weight comes back from ``tensors`` as stored (a ``quant.Packed`` over one read
buffer, on the device), so a ring slot holds the packed bytes; ``TorchHooks.expand`` dequantizes a
layer into the compute dtype, and ``tensor`` (the kernel's resident parts) dequantizes at once. A
load refuses scales, biases and 1-D tensors (norms, linear biases) holding inf or NaN, the first
time each is read in the process.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from spill.engines.core.reader import RESIDENT_FRACTION, ShardFiles
from spill.engines.core.ring import Hooks
from spill.engines.torch import int4
from spill.engines.torch.quant import CHUNK_VALUES, Packed, dequantize
from spill.models.quant import not_finite
from spill.models.weights import WeightFiles

MAPPED = "_spill_mapped"  # set on a tensor that views a mapped file: read-only, never pooled


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


_PACKED = {**_DTYPES, "U32": torch.int32}  # a packed weight's words, read as int32 (same bits)


# Reads go through ``core.reader.ShardFiles`` (``pread``, never a long-lived mmap) into memory torch
# owns. On a CPU the bytes land in one reused staging buffer, or straight in output tensors recycled
# from released ring slots: fresh memory costs a page fault per 4 KiB, which on this kind of machine
# cut a warm read from ~11 GB/s to ~2 GB/s. A streamed layer on a CPU whose file holds the compute
# dtype is not copied at all: ``TorchHooks`` has the loader map its range (``ShardFiles.map``) and
# the slot's tensors are views of the page cache, unmapped when the ring drops the slot (they are
# never written: weights are frozen). spill replaces model files by rename, which leaves a mapping
# intact; a file truncated in place under a running job would end it with SIGBUS where a read would
# fail in one line.
class WeightReader:
    """Tensors by HF name from a folder's shards, on ``device`` in the compute dtype; a packed
    weight (``quantized``: name -> (bits, group_size)) comes back as a ``Packed`` from
    ``tensors`` and dequantized from ``tensor``; with ``kernel`` (the int4 kernel's file of the
    model) the 4-bit modules that file holds come back in its layout, ready to compute on."""

    def __init__(
        self,
        files: WeightFiles,
        device: torch.device,
        dtype: torch.dtype,
        quantized: dict[str, tuple[int, int]] | None = None,
        kernel: WeightFiles | None = None,
    ):
        self.files, self.device, self.dtype = files, device, dtype
        self.quantized = dict(quantized or {})
        # the int4 kernel's file (``int4_file``): the 4-bit modules it holds are read from it
        self._kernel_files = ShardFiles(kernel) if kernel is not None else None
        self._kernel_names = frozenset(int4.held(kernel, self.quantized) if kernel else ())
        self._shards = ShardFiles(files)
        self._lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._staging = torch.empty(0, dtype=torch.uint8)
        self._pool: dict[tuple, list[torch.Tensor]] = {}  # (shape, dtype) -> free tensors
        self._pooling = device.type == "cpu"
        self._local = threading.local()  # .mapping: this thread's loads map, not copy
        self._checked: set[str] = set()  # tensors found finite (``_check_finite``)

    @contextmanager
    def mapping(self) -> Iterator[None]:
        """Within, on this thread: same-dtype ranges on a CPU come back as views of the page
        cache (``ShardFiles.map``) instead of copies; nobody may write to them."""
        self._local.mapping = True
        try:
            yield
        finally:
            self._local.mapping = False

    def recycle(self, tensors) -> None:
        """Take back a released slot's tensors (a ``Packed``: its read buffer, once) for the
        next load (CPU only; CUDA's caching allocator already reuses device memory)."""
        if not self._pooling:
            return
        seen: set[int] = set()
        with self._lock:
            for t in _owned(tensors):
                if id(t) in seen or getattr(t, MAPPED, False):  # a mapped file is not ours
                    continue
                seen.add(id(t))
                self._pool.setdefault((tuple(t.shape), t.dtype), []).append(t)

    def _output(self, shape: tuple, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if not self._pooling:
            return torch.empty(shape, dtype=dtype, device=self.device)
        with self._lock:
            free = self._pool.get((shape, dtype))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype)

    @property
    def bytes_read(self) -> int:
        """Bytes of tensor data read or mapped so far, the int4 kernel's file's too (benchmarks
        count a pass with it)."""
        kernel = self._kernel_files.bytes_read if self._kernel_files is not None else 0
        return self._shards.bytes_read + kernel

    def drop_behind(self) -> None:
        """Leave no read range in the page cache (a memory budget is in force: ``core.reader``)."""
        self._shards.drop = True
        if self._kernel_files is not None:
            self._kernel_files.drop = True

    @property
    def dropping(self) -> bool:
        """Whether reads leave no page cache behind (``drop_behind``: a budget is in force)."""
        return self._shards.drop

    def has(self, name: str) -> bool:
        return self._shards.has(name)

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor in the compute dtype (a packed weight dequantized, into memory of its own)."""
        t = self.tensors([name])[name]
        with self._read_lock:  # a one-off (an embedding: 108 MiB of float32 staged for SmolLM2)
            self._staging = torch.empty(0, dtype=torch.uint8)  # is not kept for the layers
        if isinstance(t, Packed):
            return dequantize(t, torch.empty(t.shape, dtype=self.dtype, device=self.device))
        return t

    def unpack(self, p: Packed) -> torch.Tensor:
        """``p`` dequantized into the compute dtype, in a tensor from the pool (``recycle``),
        through this thread's float32 scratch (kept: a fresh one each time faults its pages in,
        10x the dequantization of an MoE expert under a budget's heap trims, measured)."""
        out = self._output(p.shape)
        if out.dtype == torch.float32:
            return dequantize(p, out)
        need = min(CHUNK_VALUES, out.numel())  # what ``dequantize_into`` takes at most
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.numel() < need or scratch.device != out.device:
            scratch = self._local.scratch = torch.empty(
                need, dtype=torch.float32, device=out.device
            )
        return dequantize(p, out, scratch)

    def tensors(self, names) -> dict:
        """Several tensors, one ``pread`` per contiguous byte range; a packed weight comes back
        as a ``Packed`` (its scales and biases are not listed separately), or as an
        ``int4.Int4Weight`` read from the kernel's file where that holds it."""
        names = list(names)
        packed = [n for n in names if n in self.quantized]
        out = self._floats([n for n in names if n not in self.quantized])
        kernel = [n for n in packed if n in self._kernel_names]
        if kernel:
            out.update(self._kernel(kernel))
        if len(kernel) < len(packed):
            out.update(self._packed([n for n in packed if n not in self._kernel_names]))
        return {n: out[n] for n in names}

    def _raw(
        self, shards: ShardFiles, parts, dtypes
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``parts`` as stored, name -> (tensor, the buffer it views): one buffer per byte range,
        a page-cache mapping within ``mapping``, on ``device``."""
        raw = {}
        for r in shards.ranges(parts, dtypes):
            if self._pooling and getattr(self._local, "mapping", False):
                with warnings.catch_warnings():  # read-only memory: fine, weights are frozen
                    warnings.simplefilter("ignore", UserWarning)
                    buf = torch.frombuffer(shards.map(r), dtype=torch.uint8)
                setattr(buf, MAPPED, True)  # never recycled into the pool
            else:
                buf = self._output((r.nbytes,), torch.uint8) if self._pooling else None
                host = buf if buf is not None else torch.empty(r.nbytes, dtype=torch.uint8)
                shards.pread(r.fd, [host.numpy()], r.start, r.shard)
                buf = host.to(self.device)
            for lo, hi, name, info in r.tensors:
                t = buf[lo:hi]
                if t.storage_offset() % dtypes[info["dtype"]].itemsize:  # unaligned in its file
                    t = t.clone()
                raw[name] = (t.view(dtypes[info["dtype"]]).reshape(info["shape"]), buf)
        return raw

    def _packed(self, names) -> dict[str, Packed]:
        """Packed weights with their scales and biases, as stored (``_raw``)."""
        modules = [n.removesuffix(".weight") for n in names]
        parts = [f"{m}.{p}" for m in modules for p in ("weight", "scales", "biases")]
        raw = self._raw(self._shards, parts, _PACKED)
        out = {}
        for name, m in zip(names, modules, strict=True):
            bits, group = self.quantized[name]
            weight, buf = raw[f"{m}.weight"]
            scales, biases = raw[f"{m}.scales"][0], raw[f"{m}.biases"][0]
            out[name] = Packed(weight, scales, biases, bits, group, buf)
        self._check_finite({n: t for n, (t, _) in raw.items() if not n.endswith(".weight")})
        return out

    # Later loads of a streamed layer read the same bytes, so each tensor is checked the first time
    # only. Scales, biases and 1-D tensors are small, so this costs little beside the read (measured
    # in docs/quantized.md); a float model's large matrices are not checked here.
    def _check_finite(self, tensors: dict[str, torch.Tensor], files: WeightFiles | None = None):
        """Refuse a load whose small tensors (scales, biases, norms: a fraction of its bytes)
        hold inf or NaN, before anything computes on them: each tensor once a process (a
        streamed layer's later loads read the same bytes), one reduction and sync a load."""
        tensors = {n: t for n, t in tensors.items() if n not in self._checked}
        if not tensors:
            return
        ok = torch.stack([torch.isfinite(t).all() for t in tensors.values()])
        if bool(ok.all()):
            self._checked.update(tensors)
            return
        name = next(n for n, good in zip(tensors, ok.tolist(), strict=True) if not good)
        files = files or self.files
        raise not_finite(files.folder / files.tensor_shard[name], name)

    def _kernel(self, names) -> dict[str, int4.Int4Weight]:
        """4-bit weights in the int4 kernel's layout, from its file (``int4_file``)."""
        modules = [n.removesuffix(".weight") for n in names]
        parts = [f"{m}.{p}" for m in modules for p in (int4.WORDS, int4.SCALE_ZERO)]
        raw = self._raw(self._kernel_files, parts, _PACKED)
        out = {}
        for name, m in zip(names, modules, strict=True):
            words, buf = raw[f"{m}.{int4.WORDS}"]
            scale_zero = raw[f"{m}.{int4.SCALE_ZERO}"][0]
            out[name] = int4.Int4Weight(words, scale_zero, self.quantized[name][1], buf)
        zeros = {n: t for n, (t, _) in raw.items() if n.endswith(int4.SCALE_ZERO)}
        self._check_finite(zeros, self._kernel_files.files)
        return out

    def _floats(self, names) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        if not names:
            return out
        pread = self._shards.pread
        mapping = getattr(self._local, "mapping", False)
        for r in self._shards.ranges(names, _DTYPES):
            same = all(_DTYPES[f["dtype"]] == self.dtype for *_, f in r.tensors)
            if self._pooling and same and mapping:
                with warnings.catch_warnings():  # read-only memory: fine, weights are frozen
                    warnings.simplefilter("ignore", UserWarning)
                    raw = torch.frombuffer(self._shards.map(r), dtype=torch.uint8)
                for lo, hi, name, info in r.tensors:
                    out[name] = _as(raw[lo:hi], info)
                    setattr(out[name], MAPPED, True)  # never recycled into the pool
            elif self._pooling and same:
                # Same dtype on a CPU: scatter the range straight into the output tensors.
                outs = [self._output(tuple(f["shape"])) for *_, f in r.tensors]
                pread(
                    r.fd, [o.reshape(-1).view(torch.uint8).numpy() for o in outs], r.start, r.shard
                )
                out.update({name: o for (_, _, name, _), o in zip(r.tensors, outs, strict=True)})
            elif not self._pooling:
                raw = torch.empty(r.nbytes, dtype=torch.uint8)
                pread(r.fd, [raw.numpy()], r.start, r.shard)
                for lo, hi, name, info in r.tensors:
                    # Move first, then convert: bf16 files cross to a GPU at half the bytes.
                    out[name] = _as(raw[lo:hi], info).to(self.device).to(self.dtype).contiguous()
            else:
                # A CPU converting dtypes: one tensor at a time through a staging buffer the
                # size of the largest tensor, still in file order.
                with self._read_lock:
                    for lo, hi, name, info in r.tensors:
                        if self._staging.numel() < hi - lo:
                            self._staging = torch.empty(hi - lo, dtype=torch.uint8)
                        raw = self._staging[: hi - lo]
                        pread(r.fd, [raw.numpy()], r.start + lo, r.shard)
                        out[name] = self._output(tuple(info["shape"])).copy_(_as(raw, info))
        self._check_finite({n: t for n, t in out.items() if t.dim() == 1})  # norms, biases
        return out

    def close(self) -> None:
        self._shards.close()
        if self._kernel_files is not None:
            self._kernel_files.close()
        with self._lock:
            self._pool.clear()
            self._staging = torch.empty(0, dtype=torch.uint8)


def _owned(tensors) -> Iterator[torch.Tensor]:
    """The tensors that hold the memory of ``tensors`` (a ``Packed`` or an ``Int4Weight``: its
    read buffer)."""
    for t in tensors:
        if isinstance(t, Packed) or (isinstance(t, int4.Int4Weight) and t.buffer is not None):
            yield t.buffer
        elif isinstance(t, int4.Int4Weight):
            yield from (t.packed, t.scale_zero)
        else:
            yield t


# ``TorchHooks`` gives CUDA a side stream, so layer copies overlap compute on the default stream.
# ``expand`` dequantizes on the ring's prefetch thread (see ``core.ring``) into tensors recycled
# from an earlier use.
class TorchHooks(Hooks):
    """CPU: released slots go back to the reader's pool. CUDA (streaming): loads run on a side
    stream, and compute on the default stream marks each tensor it uses, so the caching
    allocator frees it only after that compute. A packed layer is dequantized per use
    (``expand``) into pooled tensors that ``discard`` takes back."""

    def __init__(
        self, reader: WeightReader, stream: torch.cuda.Stream | None, map_layers: bool = False
    ):
        self.reader, self.stream, self.map = reader, stream, map_layers
        self.expands = bool(reader.quantized)

    def load(self, fn, i: int):
        if self.stream is None:
            if self.map:  # a streamed CPU layer: views of the page cache, no copy
                with self.reader.mapping():
                    return fn(i)
            return fn(i)
        with torch.cuda.stream(self.stream):
            w = fn(i)
        self.stream.synchronize()  # blocks the loader thread only
        return w

    def ready(self, w):
        if self.stream is not None:
            current = torch.cuda.current_stream(self.stream.device)
            for tensor in w.values():
                if isinstance(tensor, Packed | int4.Int4Weight):
                    tensor = tensor.buffer
                tensor.record_stream(current)  # freed only after compute used it
        return w

    def expand(self, w):
        if not any(isinstance(t, Packed) for t in w.values()):
            return w
        if self.stream is None:
            return {k: self.reader.unpack(t) if isinstance(t, Packed) else t for k, t in w.items()}
        with torch.cuda.stream(self.stream):  # beside compute, as the load was
            x = {k: self.reader.unpack(t) if isinstance(t, Packed) else t for k, t in w.items()}
        self.stream.synchronize()
        return x

    def discard(self, x, w) -> None:
        self.reader.recycle([x[k] for k, t in w.items() if isinstance(t, Packed)])

    def release(self, w) -> None:
        self.reader.recycle(list(w.values()))
