"""The affine quantized copy of a float model (``spill models quantize``), beside it in the cache at
``models/quantized/<name>-q<bits>g<group>``, named ``<name>@q<bits>g<group>``.

``make_copy`` writes it (``resolve.quantize_model`` and ``--quantize``'s ``resolve.quantized_copy``
call it with a resolved model): written to a temporary folder and renamed, every file's sha256
recorded. ``identity`` is what a run's identity records about a quantized base;
``dequantize_folder`` writes a quantized folder's float32 values.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spill.errors import ModelError
from spill.ground.paths import models_dir
from spill.models.cache import is_model_file, read_marker
from spill.models.config import load_config
from spill.models.integrity import record
from spill.models.names import safe_name
from spill.models.quant import (
    BITS,
    GROUP_SIZES,
    Spec,
    config_entry,
    dequantize,
    describe,
    quantize,
    safetensors_entries,
)
from spill.models.weights import INDEX, weight_files
from spill.store.safetensors_io import bf16_bits_to_float32, read_header, write_file

_STORED = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32}
# As mlx-lm's ``convert -q`` picks them: every linear and embedding weight whose rows split into
# whole groups (q/k/v/o, the MLP, ``embed_tokens``, an untied ``lm_head``); norms and biases stay as
# they are.
QUANTIZABLE = ("_proj.weight", "embed_tokens.weight", "lm_head.weight")


def tag(bits: int, group_size: int) -> str:
    return f"q{bits}g{group_size}"


def quantized_folder(name: str, bits: int, group_size: int) -> Path:
    """Where ``<name>@q<bits>g<group>`` lives in the cache."""
    return models_dir() / "quantized" / safe_name(f"{name}-{tag(bits, group_size)}")


def _read(path: Path) -> dict[str, tuple[str, np.ndarray]]:
    """A safetensors file as ``{name: (dtype code, numpy array)}`` (BF16 as uint16 bits); the
    whole file is read (quantizing needs every weight once)."""
    header = read_header(path)
    with open(path, "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _STORED:
            raise ModelError(
                f"{path}: tensor {name} is {info['dtype']}; spill reads F32, F16, BF16 and U32 here"
            )
        lo, hi = info["data_offsets"]
        raw = np.array(data[start + lo : start + hi])  # a copy: the map closes with this function
        out[name] = (info["dtype"], raw.view(_STORED[info["dtype"]]).reshape(info["shape"]))
    return out


# ``quant.quantize`` gives mx.quantize's bits, and scales and biases keep the weight's dtype (bf16
# stays bf16), as mlx-lm stores them. Shard names and the index are kept.
def quantize_folder(
    source: Path, dest: Path, bits: int, group_size: int, progress: Callable[[str], object]
) -> dict[str, Spec]:
    """Write the quantized copy of the float folder ``source`` to ``dest`` (a new folder)."""
    Spec(bits, group_size).check("spill models quantize")
    if bits not in BITS or group_size not in GROUP_SIZES:
        raise ModelError(
            f"--group-size {group_size} is not one mlx takes; use {'/'.join(map(str, GROUP_SIZES))}"
        )
    if load_config(source).quantization:
        raise ModelError(f"{source}: already quantized; quantize the float model it came from")
    files = weight_files(source)
    specs: dict[str, Spec] = {}
    dest.mkdir(parents=True)
    for shard in files.shards:
        out = {}
        for name, (dtype, w) in _read(source / shard).items():
            module = name.removesuffix(".weight")
            if name.endswith(QUANTIZABLE) and w.ndim == 2 and w.shape[1] % group_size == 0:
                out.update(safetensors_entries(module, *quantize(w, bits, group_size), dtype))
                specs[module] = Spec(bits, group_size)
            else:
                out[name] = (dtype, w)
        write_file(dest / shard, out, {"format": "pt"})
        progress(f"quantized {shard}: {sum(1 for n in out if n.endswith('.scales'))} tensors")
    if not specs:
        raise ModelError(
            f"{source}: no weight's rows split into groups of {group_size}; use a smaller "
            "--group-size"
        )
    if (source / INDEX).is_file():
        index = json.loads((source / INDEX).read_bytes())
        weight_map = {}
        for name, shard in index["weight_map"].items():
            module = name.removesuffix(".weight")
            parts = ("weight", "scales", "biases") if module in specs else (None,)
            weight_map.update({f"{module}.{p}" if p else name: shard for p in parts})
        index["weight_map"] = dict(sorted(weight_map.items()))
        index.get("metadata", {}).pop("total_size", None)  # the packed size differs
        (dest / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((source / "config.json").read_bytes())
    config["quantization"] = config_entry(specs)
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in sorted(source.iterdir()):  # tokenizer, generation config, chat template
        if is_model_file(path.name) and not (dest / path.name).exists():
            shutil.copyfile(path, dest / path.name)
    return specs


def make_copy(
    source: Path,
    name: str,
    model_id: str | None,
    spec: Spec,
    dest: Path,
    progress: Callable[[str], object],
) -> Path:
    """Write the ``spec`` copy of the model ``name`` in ``source`` to ``dest``: a temporary
    folder, recorded (``source`` as its ``uri``), then renamed (another process that renamed its
    own first wins, and its copy is used)."""
    bits, group_size = spec.bits, spec.group_size
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.quantizing"
    try:
        quantize_folder(source, tmp, bits, group_size, progress)
        fields = {"name": f"{name}@{tag(bits, group_size)}", "source": "quantized"}
        fields["uri"] = str(source)
        if model_id:
            fields["model_id"] = model_id
        record(tmp, **fields)
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def identity(folder: Path) -> dict | None:
    """What a run's identity says about a quantized base (None: float weights): the bits and
    group size of most modules, where the values came from (the GGUF types it kept, spill's own
    quantizer, or another affine folder) and the pre-run line's words for it."""
    config = load_config(folder)
    if not config.quantization:
        return None
    marker = read_marker(folder)
    tensors = marker.get("tensors") or {}
    kept = [t["ggml_type"] for t in tensors.values() if isinstance(t, dict) and "bits" in t]
    bits, group = next((b, g) for m, b, g in config.quantization if m == "")
    if kept:
        source = "GGUF " + "/".join(sorted(set(kept)))
    else:
        source = "spill affine" if marker.get("source") == "quantized" else "affine"
    text = describe(config.quantization, kept)
    return {"bits": bits, "group_size": group, "source": source, "format": text}


def dequantize_folder(source: Path, dest: Path) -> Path:
    """Write the float32 folder of a quantized folder's values to ``dest`` (a new folder): every
    packed weight becomes ``scale * q + bias`` in float32 (``quant.dequantize``, the values the
    engines compute with), other tensors and the shard layout are kept and ``config.json`` loses
    its ``quantization``. What a PEFT adapter trained on a quantized base applies to."""
    cfg = load_config(source)
    if not cfg.quantization:
        raise ModelError(f"{source}: not quantized; it is already a float folder")
    files = weight_files(source)
    dest.mkdir(parents=True)
    for shard in files.shards:
        tensors = _read(source / shard)
        out = {}
        for name, (dtype, a) in tensors.items():
            module = name.rsplit(".", 1)[0]
            if name.endswith((".scales", ".biases")):
                continue
            if dtype == "U32" and f"{module}.scales" in tensors:
                s, b = (tensors[f"{module}.{p}"] for p in ("scales", "biases"))
                s, b = (
                    bf16_bits_to_float32(x[1]) if x[0] == "BF16" else x[1].astype(np.float32)
                    for x in (s, b)
                )
                out[name] = ("F32", dequantize(a, s, b, *cfg.quant_spec(module)))
            else:
                out[name] = (dtype, a)
        write_file(dest / shard, out, {"format": "pt"})
    if (source / INDEX).is_file():
        index = json.loads((source / INDEX).read_bytes())
        index["weight_map"] = {
            n: s for n, s in index["weight_map"].items() if not n.endswith((".scales", ".biases"))
        }
        (dest / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((source / "config.json").read_bytes())
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in sorted(source.iterdir()):
        if is_model_file(path.name) and not (dest / path.name).exists():
            shutil.copyfile(path, dest / path.name)
    return dest
