"""One pass over a model file (``scan_file``, ``checked_sha256``): its sha256 and, for a safetensors
file, whether every float tensor (F32, F16, BF16 by its header) holds only finite values;
``NotFinite`` names the file and the tensor. A header that cannot be parsed is only hashed: the
readers refuse such a file in one line.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

from spill.errors import ModelError

CHUNK = 1 << 22
HEADER_LIMIT = 100_000_000  # as spill.store.safetensors_io.read_header
# dtype -> (its bits as unsigned integers, the exponent mask)
EXPONENT = {
    "F32": (np.dtype("<u4"), 0x7F800000),
    "F16": (np.dtype("<u2"), 0x7C00),
    "BF16": (np.dtype("<u2"), 0x7F80),
}


class NotFinite(ModelError):
    """A model file whose float tensor holds NaN or inf."""


def not_finite(path: Path | str, tensor: str) -> str:
    """The words ``spill.models.quant.not_finite`` says of a tensor a reader found."""
    return (
        f"{path}: {tensor} holds NaN or inf, so every output computed from it would too; the "
        "model's weights are damaged"
    )


# Every byte of a model file is read once already where its sha256 is taken (a source recording the
# files it wrote, a job start re-hashing a file whose stat changed, ``spill models verify``, a
# folder without records fingerprinted); the check rides on that read, in the same chunks, so a
# large matrix holding NaN or inf (an embedding, a linear: the readers check only scales, biases and
# 1-D tensors as they load) is refused before any job computes with it. A value is inf or NaN
# exactly when its exponent bits are all set: each chunk is masked as unsigned integers in scratch
# memory of the chunk's size, with no conversion (bf16 as ``spill.models.quant.finite`` reads it).
class Scan:
    """sha256 of the bytes fed in order (``update``), and the first float tensor holding NaN or
    inf (``bad``) when they are a safetensors file (``tensors=True``)."""

    def __init__(self, tensors: bool):
        self.sha = hashlib.sha256()
        self.pos = 0
        self.head: bytearray | None = bytearray() if tensors else None  # until parsed
        self.ranges: list[tuple[int, int, str, np.dtype, int]] = []  # start, end, name, bits, mask
        self.next = 0  # the first range not yet passed
        self.tail = b""  # an element split between two chunks
        self.bad: str | None = None
        self.scratch: dict[np.dtype, np.ndarray] = {}

    def update(self, chunk: bytes | memoryview) -> None:
        self.sha.update(chunk)
        view, start = memoryview(chunk).cast("B"), self.pos
        self.pos += len(view)
        if self.head is not None:
            self._header(view, start)
        if self.ranges and self.bad is None:
            self._check(view, start)

    def hexdigest(self) -> str:
        return self.sha.hexdigest()

    def _header(self, view: memoryview, start: int) -> None:
        """Collect the header's bytes (the file's first, so every earlier chunk went in whole);
        once complete, the byte ranges of its float tensors."""
        head = self.head

        def take(upto: int) -> None:  # the file's bytes [len(head), upto) from this chunk
            head.extend(view[len(head) - start : max(0, upto - start)])

        take(8)
        if len(head) < 8:
            return
        n = struct.unpack("<Q", head[:8])[0]
        if n > HEADER_LIMIT:
            self.head = None
            return
        take(8 + n)
        if len(head) < 8 + n:
            return
        self.head = None
        try:
            header = json.loads(bytes(head[8:]))
            for name, info in header.items():
                packed = name.endswith(".weight") and f"{name[:-7]}.scales" in header
                if packed:  # a float beside its scales: the readers refuse its form by name
                    continue
                if name != "__metadata__" and info.get("dtype") in EXPONENT:
                    bits, mask = EXPONENT[info["dtype"]]
                    a, b = info["data_offsets"]
                    if isinstance(a, int) and isinstance(b, int) and 0 <= a < b:
                        self.ranges.append((8 + n + a, 8 + n + b, name, bits, mask))
        except (ValueError, UnicodeDecodeError, RecursionError, AttributeError, TypeError):
            self.ranges = []  # unparsable: hashed only, the readers name it
        self.ranges.sort(key=lambda r: r[0])

    def _check(self, view: memoryview, start: int) -> None:
        end = start + len(view)
        while self.next < len(self.ranges):
            a, b, name, bits, mask = self.ranges[self.next]
            if a >= end:
                return
            seg = view[max(a, start) - start : min(b, end) - start]
            size = bits.itemsize
            if self.tail:
                take = size - len(self.tail)
                self.tail += bytes(seg[:take])
                seg = seg[take:]
                if len(self.tail) == size and self._holds_nonfinite(self.tail, bits, mask):
                    self.bad = name
                    return
                if len(self.tail) == size:
                    self.tail = b""
            whole = len(seg) - len(seg) % size
            if whole and self._holds_nonfinite(seg[:whole], bits, mask):
                self.bad = name
                return
            self.tail += bytes(seg[whole:])
            if b > end:
                return
            self.next, self.tail = self.next + 1, b""

    def _holds_nonfinite(self, data, bits: np.dtype, mask: int) -> bool:
        values = np.frombuffer(data, dtype=bits)
        scratch = self.scratch.get(bits)
        if scratch is None or len(scratch) < len(values):
            scratch = self.scratch[bits] = np.empty(max(len(values), CHUNK // bits.itemsize), bits)
        out = scratch[: len(values)]
        np.bitwise_and(values, bits.type(mask), out=out)
        return bool(out.max() == mask)


def scan_file(path: Path) -> tuple[str, str | None]:
    """(hex sha256 of ``path``, the first float tensor holding NaN or inf, or None); only a
    ``*.safetensors`` file's tensors are looked at."""
    path = Path(path)
    scan = Scan(path.name.endswith(".safetensors"))
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            scan.update(view[:n])
    return scan.hexdigest(), scan.bad


def checked_sha256(path: Path) -> str:
    """``scan_file``'s sha256, or ``NotFinite`` in one line naming the file and the tensor."""
    digest, bad = scan_file(path)
    if bad is not None:
        raise NotFinite(f"{not_finite(path, bad)}: import, fetch or generate it again")
    return digest
