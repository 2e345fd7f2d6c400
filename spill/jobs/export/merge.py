"""The inputs of ``spill export`` (``open_inputs``) and the merged weights they give (``plan``,
``merged``), one tensor at a time: memory is one tensor, not the model.

An export starts from a finished tune's adapter folder (``<state>/adapter``, spill's layout), the
tune's state folder itself, or a PEFT adapter folder (another trainer's too: its base given by
``--model``, unchecked, since PEFT records no fingerprint). The base is resolved by name as
``find_model`` resolves any model, and refused when its fingerprint is not the one the adapter was
trained on. Every adapted linear becomes ``W + scale * (A @ B).T`` computed in float32.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spill.errors import SpillError
from spill.jobs.adapter_files import ADAPTER, Adapter, load_adapter
from spill.jobs.loading import find_model
from spill.models.config import ModelConfig, load_config
from spill.models.integrity import same_weights
from spill.models.quant import dequantize
from spill.models.sources.quantize import identity
from spill.models.weights import WeightFiles, weight_files
from spill.store.safetensors_io import bf16_bits_to_float32

_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32}


@dataclass(frozen=True)
class Inputs:
    """What an export reads: the adapter, and the base it was trained on, checked."""

    adapter_dir: Path
    adapter: Adapter
    meta: dict  # adapter.json
    base_name: str
    base_folder: Path
    fingerprint: str
    config: ModelConfig
    raw_config: dict  # config.json as stored
    quantization: dict | None  # a quantized base's identity (models.sources.quantize.identity)

    @property
    def dequantized(self) -> bool:
        return self.quantization is not None


def adapter_folder(path: Path) -> Path:
    """The adapter folder that ``path`` names: itself, or a tune state folder's ``adapter/``."""
    path = Path(path)
    if not path.is_dir():
        raise SpillError(f"{path}: no such folder; give a tune's adapter folder or its state")
    if (path / "adapter.json").is_file() or (path / "params.safetensors").is_file():
        return path
    if (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file():
        return path  # PEFT's layout (spill's peft/, or another trainer's)
    if (path / ADAPTER / "adapter.json").is_file():
        return path / ADAPTER
    if (path / "control.json").is_file() or (path / "payloads").is_dir():
        raise SpillError(
            f"{path}: this tune has not finished (no adapter/ yet); finish it (spill resume "
            f"{path}) and export again"
        )
    raise SpillError(
        f"{path}: no spill adapter here (adapter.json + params.safetensors); give a finished "
        "tune's adapter folder or its state folder"
    )


def open_inputs(
    path: Path, model: str | None, weights: str | None, progress: Callable[[str], object]
) -> Inputs:
    """Read the adapter at ``path``, resolve its base (``model`` overrides the name it
    records) and refuse a base whose fingerprint is not the adapter's, in one line."""
    folder = adapter_folder(path)
    meta_path = folder / "adapter.json"
    meta = json.loads(meta_path.read_bytes()) if meta_path.is_file() else {}
    adapter = load_adapter(folder)  # validates adapter.json, names a damaged file
    name = model or meta.get("base_model")
    if not name:
        what = (
            "names no base model (an older adapter)"
            if meta_path.is_file()
            else ("is a PEFT adapter, which records no weight fingerprint")
        )
        raise SpillError(f"{folder} {what}; give its base model with --model NAME")
    resolved, fp = find_model(name, weights)
    want = meta.get("fingerprint")
    if want and not same_weights(want, Path(resolved.folder), fp, str(folder), "the export"):
        raise SpillError(
            f"{folder} was trained on weights {want[:19]}..., but {name} is {fp[:19]}...: "
            "another model; give --model the base it was tuned on"
        )
    if not want:
        progress(f"{folder} records no base fingerprint; trusting --model {name}")
    base = Path(resolved.folder)
    raw = json.loads((base / "config.json").read_bytes())
    return Inputs(folder, adapter, meta, name, base, fp, load_config(base), raw, identity(base))


class _Shards:
    """``pread`` of one tensor at a time from a model folder's shards."""

    def __init__(self, files: WeightFiles):
        self.files = files
        self.fds: dict[str, tuple[int, int]] = {}

    def read(self, name: str) -> tuple[str, np.ndarray]:
        shard = self.files.tensor_shard[name]
        if shard not in self.fds:
            fd = os.open(self.files.folder / shard, os.O_RDONLY)
            self.fds[shard] = (fd, 8 + struct.unpack("<Q", os.pread(fd, 8, 0))[0])
        fd, start = self.fds[shard]
        info = self.files.tensor_info(name)
        if info["dtype"] not in _NUMPY:
            raise SpillError(
                f"{self.files.folder / shard}: tensor {name} is {info['dtype']}; spill exports "
                "F32, F16, BF16 and affine quantized (U32) weights"
            )
        lo, hi = info["data_offsets"]
        raw = os.pread(fd, hi - lo, start + lo)
        arr = np.frombuffer(raw, dtype=_NUMPY[info["dtype"]]).reshape(info["shape"])
        return info["dtype"], arr

    def float32(self, name: str) -> np.ndarray:
        dtype, arr = self.read(name)
        return bf16_bits_to_float32(arr) if dtype == "BF16" else arr.astype(np.float32)

    def close(self) -> None:
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _order(cfg: ModelConfig) -> Callable[[str], tuple]:
    """HF's order: the embedding, the layers by number (each in its ``layer_keys`` order, an MoE
    layer's experts by number), the final norm, the head."""
    ranks: dict[int, dict[str, int]] = {}

    def key(name: str) -> tuple:
        if name.startswith("model.layers."):
            k, rest = name[len("model.layers.") :].split(".", 1)
            i = int(k)
            if i not in ranks:
                ranks[i] = {n: r for r, n in enumerate(cfg.layer_keys(i))}
            return (1, i, ranks[i].get(rest, len(ranks[i])), rest)
        rank = {"model.embed_tokens.weight": 0, "model.norm.weight": 2, "lm_head.weight": 3}
        return (rank.get(name, 4), 0, 0, name)

    return key


def plan(inputs: Inputs) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, float shape)`` of every tensor the merged model has, in HF order (a quantized
    weight's ``scales`` and ``biases`` fold into it)."""
    files = weight_files(inputs.base_folder)
    out = []
    for name in sorted(files.tensor_shard, key=_order(inputs.config)):
        module = name.rsplit(".", 1)[0]
        if name.endswith((".scales", ".biases")) and f"{module}.weight" in files.tensor_shard:
            continue
        shape = tuple(files.tensor_info(name)["shape"])
        if f"{module}.scales" in files.tensor_shard:
            bits, _ = inputs.config.quant_spec(module)
            shape = (shape[0], shape[1] * 32 // bits)
        out.append((name, shape))
    return out


# ``A`` is ``[in, r]``, ``B`` ``[r, out]``, spill's names; a quantized weight (mlx-lm's affine
# layout) is first dequantized to the float32 values the engines compute with. Tensors are read with
# ``pread`` one at a time. The base's files are checked against their recorded sha256 when it is
# resolved.
def merged(inputs: Inputs, names: list[str] | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """``(name, float32 array)`` of every tensor of the merged model, in ``plan`` order, or of
    ``names`` in their order (a GGUF stacks an MoE layer's experts projection by projection)."""
    files = weight_files(inputs.base_folder)
    params, scale = inputs.adapter.params, np.float32(inputs.adapter.lora.scale)
    shapes = dict(plan(inputs))
    order = [(n, shapes[n]) for n in names] if names is not None else list(shapes.items())
    for key in sorted(params):
        if f"model.{key.rsplit('.', 1)[0]}.weight" not in shapes:
            raise SpillError(
                f"{inputs.adapter_dir}: adapter tensor {key} has no weight in {inputs.base_name}; "
                "export it onto the model it was tuned on"
            )
    shards = _Shards(files)
    try:
        for name, shape in order:
            module = name.rsplit(".", 1)[0]
            if f"{module}.scales" in files.tensor_shard:
                _, packed = shards.read(name)
                s, b = shards.float32(f"{module}.scales"), shards.float32(f"{module}.biases")
                w = dequantize(packed, s, b, *inputs.config.quant_spec(module))
            else:
                w = shards.float32(name)
            stem = module.removeprefix("model.")  # layers.<k>.self_attn.q_proj
            if name.endswith(".weight") and f"{stem}.lora_a" in params:
                a, b = params[f"{stem}.lora_a"], params[f"{stem}.lora_b"]  # [in, r], [r, out]
                if a.shape != (shape[1], a.shape[1]) or b.shape != (a.shape[1], shape[0]):
                    raise SpillError(
                        f"{inputs.adapter_dir}: {stem} is {a.shape} x {b.shape}, which does not "
                        f"fit the base's {shape} weight; export it onto the model it was tuned on"
                    )
                w += scale * (a @ b).T  # (out, in), float32; w is this read's own copy
            yield name, np.ascontiguousarray(w, dtype=np.float32)
    finally:
        shards.close()
