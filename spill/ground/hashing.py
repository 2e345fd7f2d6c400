"""The one file hash spill computes: sha256 of a file's bytes, read in 4 MiB chunks.

It returns bare hex, hashlib's own form. Some stored formats carry a ``sha256:`` prefix (a build
state's data hash, a checkpoint's training-data identity); those callers add it where they
write, so every file already on disk keeps the form it has.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 22


def file_sha256(path: Path | str) -> str:
    """Hex sha256 of the file at ``path`` (OSError as open() raises it)."""
    with open(path, "rb", buffering=0) as f:
        return stream_sha256(f)[1]


def buffers_sha256(parts: Iterable[bytes | memoryview]) -> str:
    """Hex sha256 of the buffers' bytes one after the other (hashlib drops the GIL on large
    buffers, so a thread can hash while another writes the same memory)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
    return h.hexdigest()


def stream_sha256(f: BinaryIO) -> tuple[int, str]:
    """(bytes read, hex sha256) of a binary file object read to its end (a local file, or one
    that fsspec opened on an object store)."""
    h, size = hashlib.sha256(), 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while n := f.readinto(buf):
        h.update(view[:n])
        size += n
    return size, h.hexdigest()
