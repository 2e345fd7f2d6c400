"""The int4 kernel's layout of a 4-bit model on disk, made once per model and torch version
(``ensure``), under ``SPILL_HOME/derived/int4/<fingerprint>-torch<version>/``.

The file is derived, not a model file: never bundled, moved or verified, made again wherever it is
missing. Its sha256 and stat key are recorded beside it (``record.json``); a file whose stat key
changed is hashed again and made again when its bytes differ. Writers race harmlessly: each writes a
temporary file of its own and renames it into place, and the bytes are the same.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from spill.engines.torch import int4
from spill.engines.torch.quant import Packed
from spill.engines.torch.reader import WeightReader
from spill.ground import paths
from spill.ground.hashing import file_sha256
from spill.models.config import ModelConfig
from spill.models.weights import WeightFiles, weight_files
from spill.store.fs import fsync
from spill.store.written import synced

LAYOUT = 1  # this module's file layout; a change makes the files again
FILE = "int4.safetensors"
RECORD = "record.json"


def accepted(cfg: ModelConfig, files: WeightFiles, quantized: dict) -> list[str]:
    """The decoder modules' weight names the kernel takes, in layer order."""
    out = []
    for i in range(cfg.num_hidden_layers):
        for key in cfg.layer_keys(i):
            name = f"model.layers.{i}.{key}"
            if name in quantized:
                bits, group = quantized[name]
                rows, words = files.tensor_info(name)["shape"]
                if int4.accepts(bits, group, (rows, words * 32 // bits)):
                    out.append(name)
    return out


def _stat(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def folder_for(fingerprint: str) -> Path:
    version = torch.__version__.split("+")[0]
    return (
        paths.spill_home()
        / "derived"
        / "int4"
        / f"{fingerprint[7:23]}-torch{version}-v{LAYOUT}-b{int4.block()}"
    )


def _usable(folder: Path) -> bool:
    """Whether ``folder`` holds the file its record describes (re-hashed if its stat moved)."""
    try:
        record = json.loads((folder / RECORD).read_text())
        path = folder / FILE
        if _stat(path) == record["stat"]:
            return True
        if file_sha256(path) != record["sha256"]:
            return False
        _write_record(folder, record["sha256"])  # same bytes, touched: remember the new stat
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _write_record(folder: Path, digest: str) -> None:
    tmp = folder / f".{RECORD}.{uuid.uuid4().hex}"
    tmp.write_text(json.dumps({"sha256": digest, "stat": _stat(folder / FILE)}))
    os.replace(tmp, folder / RECORD)


# Repacking mlx-lm's words into the layout torch's int4 kernel reads (``int4.repack``) costs about
# as much as dequantizing (~5 ms a 1024-wide layer here, one thread), and a streamed layer would be
# repacked on every pass: a streamed generation spent most of its time there. So the first
# ``--packed-matmul`` open of a model writes the decoder modules the kernel takes, in its layout,
# into one safetensors file (the layout is torch's, and has changed between torch releases), layer
# after layer, so a layer is still one read. The reader then takes a layer's modules from it as they
# are stored (``pread``, or a page-cache mapping), ready to compute on.
def ensure(
    cfg: ModelConfig,
    files: WeightFiles,
    quantized: dict,
    fingerprint: str,
    note: Callable[[str], object],
) -> WeightFiles:
    """The derived file of the model ``files`` index (made now when missing or changed)."""
    folder = folder_for(fingerprint)
    if _usable(folder):
        derived = weight_files(folder)
        if derived.headers[FILE].get("__metadata__", {}).get("source") == fingerprint:
            return derived
    t0 = time.perf_counter()
    size = _make(folder, cfg, files, quantized, fingerprint)
    note(
        f"wrote the int4 kernel's layout of {files.folder.name} ({size / 1e6:.1f} MB, "
        f"{time.perf_counter() - t0:.1f} s) to {folder}: made once, read as the ring streams"
    )
    return weight_files(folder)


def _header(names: list[str], files: WeightFiles, quantized: dict, fingerprint: str) -> dict:
    header: dict = {
        "__metadata__": {"source": fingerprint, "torch": torch.__version__, "layout": str(LAYOUT)}
    }
    offset = 0
    for name in names:
        bits, group = quantized[name]
        rows, words = files.tensor_info(name)["shape"]
        cols = words * 32 // bits
        module = name.removesuffix(".weight")
        for part, dtype, shape, size in (
            (int4.WORDS, "U8", [rows, cols // 2], rows * cols // 2),
            (int4.SCALE_ZERO, "BF16", [cols // group, rows, 2], cols // group * rows * 4),
        ):
            header[f"{module}.{part}"] = {
                "dtype": dtype,
                "shape": shape,
                "data_offsets": [offset, offset + size],
            }
            offset += size
    return header


def _make(folder: Path, cfg: ModelConfig, files: WeightFiles, quantized: dict, fp: str) -> int:
    """Write the file, one layer's modules at a time; returns its size."""
    names = accepted(cfg, files, quantized)
    raw = json.dumps(_header(names, files, quantized, fp), separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{FILE}.{uuid.uuid4().hex}"
    reader = WeightReader(files, torch.device("cpu"), torch.bfloat16, quantized)
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for part in (struct.pack("<Q", len(raw)), raw):
                f.write(part)
                digest.update(part)
            for i in range(cfg.num_hidden_layers):
                layer = [n for n in names if n.startswith(f"model.layers.{i}.")]
                for p in reader.tensors(layer).values():
                    assert isinstance(p, Packed)
                    w = int4.repack(p)
                    for t in (w.packed, w.scale_zero.view(torch.uint8)):
                        data = memoryview(t.contiguous().numpy()).cast("B")
                        f.write(data)
                        digest.update(data)
            f.flush()
            synced(f.fileno())
        os.replace(tmp, folder / FILE)
        fsync(folder)
    finally:
        reader.close()
        tmp.unlink(missing_ok=True)
    _write_record(folder, digest.hexdigest())
    return (folder / FILE).stat().st_size
