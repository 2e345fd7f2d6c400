"""Read safetensors headers and write safetensors files without any tensor framework.

The header alone is enough to check a shard (its size must equal the header's last offset) and
to fingerprint a model. Writing by hand lets engine-free code emit bf16 (which safetensors'
numpy path refuses) byte for byte deterministically: tensors are laid out widest dtype first, then by name.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from spill.errors import ModelError

_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "U32": np.uint32,  # packed quantized weights (spill.models.quant)
    "U8": np.uint8,
}


def read_header(path: Path) -> dict:
    """The JSON header of a safetensors file; refuses a truncated or corrupt file in one line."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelError(
                f"{path}: truncated safetensors file ({size} bytes); delete it and fetch the model again"
            )
        (n,) = struct.unpack("<Q", head)
        if n > size - 8 or n > 100_000_000:
            raise ModelError(
                f"{path}: corrupt safetensors header (claims {n} bytes); delete it and fetch the model again"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ModelError(
                f"{path}: corrupt safetensors header; delete it and fetch the model again"
            ) from None
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if size != 8 + n + end:
        raise ModelError(
            f"{path}: truncated safetensors file ({size} bytes, header needs {8 + n + end}); delete it and fetch the model again"
        )
    return header


def float32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round float32 to bf16 (nearest, ties to even) and return the raw uint16 bits."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def encode(
    tensors: Mapping[str, tuple[str, np.ndarray]], metadata: dict[str, str] | None = None
) -> list[bytes | memoryview]:
    """A safetensors file as buffers to write in order: the length and header, then each
    tensor's own memory (no copy when an array is already contiguous in its dtype).

    ``tensors`` maps a name to ``(dtype code, array)`` ("BF16" takes uint16 bits)."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    parts: list[bytes | memoryview] = []
    # widest dtype first, then by name (as safetensors orders them): every tensor stays aligned
    for name in sorted(tensors, key=lambda n: (-np.dtype(_DTYPES[tensors[n][0]]).itemsize, n)):
        dtype, arr = tensors[name]
        data = np.ascontiguousarray(arr, dtype=_DTYPES[dtype])
        header[name] = {
            "dtype": dtype,
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + data.nbytes],
        }
        parts.append(memoryview(data.reshape(-1)).cast("B"))
        offset += data.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [struct.pack("<Q", len(raw)) + raw, *parts]


def write_file(
    path: Path,
    tensors: Mapping[str, tuple[str, np.ndarray]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``{name: (dtype, array)}`` (see ``encode``) to a local file."""
    with open(path, "wb") as f:
        for part in encode(tensors, metadata):
            f.write(part)
