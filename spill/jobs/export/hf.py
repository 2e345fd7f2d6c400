"""``spill export --format hf``: the merged model as an HF folder that transformers loads.

Sharded safetensors named as transformers names them (``model-0000K-of-0000N.safetensors``,
always with ``model.safetensors.index.json``, one shard too), shards cut before a tensor that
would take one past ``shard_bytes``; the base's ``config.json`` (a multimodal base's text
model's) without its ``quantization`` and with the output dtype; and the base's tokenizer,
generation config and chat template, copied.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spill.jobs.export.merge import Inputs, merged, plan
from spill.models.cache import is_model_file
from spill.models.config import text_config
from spill.store.safetensors_io import float32_to_bf16_bits, write_file

TORCH_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2}
SHARD_BYTES = 2 * 1024**3
_NOT_COPIED = ("config.json", "model.safetensors.index.json")


def cast(w: np.ndarray, dtype: str) -> tuple[str, np.ndarray]:
    """A float32 array in the output dtype, as ``(safetensors code, array)`` (bf16 rounds to
    nearest even, kept as uint16 bits)."""
    if dtype == "f32":
        return "F32", w
    if dtype == "f16":
        return "F16", w.astype(np.float16)
    return "BF16", float32_to_bf16_bits(w)


def shards(inputs: Inputs, dtype: str, shard_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in order."""
    out: list[list[str]] = [[]]
    size = 0
    for name, shape in plan(inputs):
        n = math.prod(shape) * _ITEMSIZE[dtype]
        if out[-1] and size + n > shard_bytes:
            out.append([])
            size = 0
        out[-1].append(name)
        size += n
    return out


def config_json(inputs: Inputs, dtype: str) -> dict:
    """The base's config.json for the merged folder: a multimodal base's text model's own (the
    merge holds only the text model's tensors, by its own names)."""
    raw = text_config(inputs.raw_config)
    config = {k: v for k, v in raw.items() if k not in ("quantization", "quantization_config")}
    config["torch_dtype"] = TORCH_DTYPES[dtype]
    if "dtype" in config:  # transformers 5 writes this name
        config["dtype"] = TORCH_DTYPES[dtype]
    return config


def copy_tokenizer(base: Path, dest: Path) -> list[str]:
    """Copy the base's tokenizer, generation config and chat template files; their names."""
    copied = []
    for path in sorted(base.iterdir()):
        name = path.name
        if path.is_file() and is_model_file(name) and not name.endswith(".safetensors"):
            if name not in _NOT_COPIED:
                shutil.copyfile(path, dest / name)
                copied.append(name)
    return copied


Entries = Callable[[str, np.ndarray], dict[str, tuple[str, np.ndarray]]]


def write_folder(
    inputs: Inputs,
    dest: Path,
    dtype: str,
    progress: Callable[[str], object],
    shard_bytes: int,
    entries: Entries,
) -> int:
    """Shards of ``entries(name, merged float32)`` for every tensor, the index and the
    tokenizer files (not config.json: the caller's); the number of shards."""
    groups = shards(inputs, dtype, shard_bytes)
    n = len(groups)
    names = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    where = {t: k for k, group in enumerate(groups) for t in group}
    weight_map, total = {}, 0
    pending: dict[str, tuple[str, np.ndarray]] = {}
    for tensor, w in merged(inputs):
        k = where[tensor]
        for key, entry in entries(tensor, w).items():
            pending[key] = entry
            total += entry[1].nbytes
            weight_map[key] = names[k]
        if tensor == groups[k][-1]:  # the shard is complete
            write_file(dest / names[k], pending, {"format": "pt"})
            progress(f"wrote {names[k]} ({len(pending)} tensors)")
            pending = {}
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    copy_tokenizer(inputs.base_folder, dest)
    return n


def write_config(dest: Path, config: dict) -> None:
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write(
    inputs: Inputs,
    dest: Path,
    dtype: str,
    quantize: None,
    progress: Callable[[str], object],
    shard_bytes: int = SHARD_BYTES,
) -> dict:
    """Fill ``dest`` with the HF folder; what export.json adds (the number of shards)."""
    assert quantize is None  # export.check_options refused it
    n = write_folder(inputs, dest, dtype, progress, shard_bytes, lambda t, w: {t: cast(w, dtype)})
    write_config(dest, config_json(inputs, dtype))
    return {"shards": n}
