"""A model folder's weight files (``weight_files``): shards, the tensor -> shard index, and the
weight fingerprint (``fingerprint``), which changes when any byte of the weights does and is part of
every checkpoint's identity, so it must cost nothing at job start: the cache records each file's
sha256 when it arrives (``spill.models.integrity``, checked at every job start) and
``cache.cached_fingerprint`` passes those records in; only a folder without records (a user's own)
is hashed here, once, and the result cached by its files' stat keys. A mixture-of-experts folder's
stacked experts (``EXPERT_STACKS``) are indexed as per-expert views into the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from spill.errors import ModelError
from spill.models.scan import checked_sha256
from spill.store.safetensors_io import read_header

INDEX = "model.safetensors.index.json"
# where a multimodal folder (Gemma 3's gemma3) keeps its text model's tensors, by the names the
# text model has on its own: transformers 5's save_pretrained and the hub's originals write
# language_model.model.*, transformers 4.52-4.57 wrote model.language_model.* beside lm_head
TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
    "lm_head.": "lm_head.",
}
# A stacked expert tensor (axis 0 the expert, so one expert's slice is a contiguous byte range) ->
# the hub's per-expert projections its rows split into, and the part they are: transformers 5's
# fused in-memory layout, and mlx-lm's switch_mlp (quantized: weight, scales, biases alike).
EXPERT_STACKS = {
    "experts.gate_up_proj": (("gate_proj", "up_proj"), "weight"),  # (E, 2I, H)
    "experts.down_proj": (("down_proj",), "weight"),  # (E, H, I)
} | {
    f"switch_mlp.{p}.{part}": ((p,), part)
    for p in ("gate_proj", "up_proj", "down_proj")
    for part in ("weight", "scales", "biases")
}
STACKED = re.compile(r"(model\.layers\.\d+\.mlp)\.(.+)")


@dataclass(frozen=True)
class WeightFiles:
    folder: Path
    shards: tuple[str, ...]
    tensor_shard: dict[str, str]  # tensor name -> shard file name
    headers: dict[str, dict]  # shard file name -> safetensors header
    # tensors of a multimodal folder beside its text model (a vision tower, its projector), which
    # no reader sees: tensor_shard and headers name the text model's by their own names
    ignored: int = 0
    viewed: int = 0  # stacked expert tensors that tensor_shard and headers name per expert
    stored: dict[str, dict] | None = None  # where viewed: headers without the views

    def stored_headers(self) -> dict[str, dict]:
        """Each shard's header without expert views (a multimodal folder's under its text
        model's names, as ever): what ``fingerprint`` hashes."""
        return self.headers if self.stored is None else self.stored

    def tensor_info(self, name: str) -> dict:
        return self.headers[self.tensor_shard[name]][name]

    def nbytes(self) -> int:
        return sum((self.folder / s).stat().st_size for s in self.shards)


def weight_files(folder: Path) -> WeightFiles:
    """Index a model folder's safetensors; names the missing or truncated shard in one line."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_bytes())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError):
            raise ModelError(f"{index}: unreadable shard index; fetch the model again") from None
        shards = tuple(sorted(set(weight_map.values())))
    else:
        shards = tuple(sorted(p.name for p in folder.glob("*.safetensors")))
        if not shards:
            raise ModelError(
                f"{folder}: no *.safetensors files; point spill at an HF-layout model folder"
            )
        weight_map = None
    headers = {}
    for shard in shards:
        path = folder / shard
        if not path.is_file():
            raise ModelError(f"{path}: shard listed in {INDEX} is missing; fetch the model again")
        headers[shard] = read_header(path)
    tensor_shard = {}
    for shard, header in headers.items():
        for name in header:
            if name != "__metadata__":
                tensor_shard[name] = shard
    if weight_map is not None:
        for name, shard in weight_map.items():
            if tensor_shard.get(name) != shard:
                raise ModelError(
                    f"{folder / shard}: tensor {name!r} listed in {INDEX} is not in that shard; fetch the model again"
                )
    return _expert_views(_text_part(WeightFiles(folder, shards, tensor_shard, headers)))


def _text_part(files: WeightFiles) -> WeightFiles:
    """The text model of a multimodal folder under its own names (``TEXT_PREFIXES``), the other
    tensors left out; a text model's folder as it is."""
    if "model.embed_tokens.weight" in files.tensor_shard:
        return files
    renamed = {}
    for name in files.tensor_shard:
        prefix = next((p for p in TEXT_PREFIXES if name.startswith(p)), None)
        if prefix is not None:
            renamed[name] = TEXT_PREFIXES[prefix] + name[len(prefix) :]
    if "model.embed_tokens.weight" not in renamed.values():
        return files  # not a multimodal folder either: check_shapes names what is missing
    headers = {
        shard: {renamed[n]: info for n, info in header.items() if n in renamed}
        | {k: v for k, v in header.items() if k == "__metadata__"}
        for shard, header in files.headers.items()
    }
    tensor_shard = {renamed[n]: s for n, s in files.tensor_shard.items() if n in renamed}
    ignored = len(files.tensor_shard) - len(tensor_shard)
    return WeightFiles(files.folder, files.shards, tensor_shard, headers, ignored)


def _expert_views(files: WeightFiles) -> WeightFiles:
    """Stacked expert tensors (``EXPERT_STACKS``) as the hub's per-expert tensors
    (``model.layers.N.mlp.experts.E.gate_proj.weight``), each a header entry for its byte range
    in the same shard; a folder without them as it is."""
    matches = {n: STACKED.fullmatch(n) for n in files.tensor_shard}
    stacked = {n: m for n, m in matches.items() if m and m[2] in EXPERT_STACKS}
    if not stacked:
        return files
    headers = {s: dict(h) for s, h in files.headers.items()}
    tensor_shard = dict(files.tensor_shard)
    experts: dict[str, tuple[int, str]] = {}  # mlp -> (experts, the tensor that says so)
    for name, m in stacked.items():
        shard = tensor_shard.pop(name)
        info = headers[shard].pop(name)
        mlp, (projections, part) = m[1], EXPERT_STACKS[m[2]]
        where = files.folder / shard
        e, seen = experts.setdefault(mlp, (info["shape"][0], name))
        if info["shape"][0] != e:
            raise ModelError(
                f"{where}: {name} holds {info['shape'][0]} experts but {seen} holds {e}; "
                "the stacked experts do not belong together: convert the model again"
            )
        for view, entry in _split(where, name, info, projections):
            key = f"{mlp}.experts.{view[0]}.{view[1]}.{part}"
            if key in tensor_shard:
                raise ModelError(
                    f"{where}: {key} is stored both alone and in {name}; "
                    "keep one layout of the experts: convert the model again"
                )
            tensor_shard[key], headers[shard][key] = shard, entry
    stored = files.stored_headers()
    return WeightFiles(
        files.folder, files.shards, tensor_shard, headers, files.ignored, len(stacked), stored
    )


def _split(where: Path, name: str, info: dict, projections: tuple[str, ...]):
    """``((expert, projection), header entry)`` of each slice of the stacked tensor ``name``:
    expert e's slab, its rows split evenly between ``projections`` (gate first)."""
    shape, (start, end) = info["shape"], info["data_offsets"]
    k = len(projections)
    if len(shape) != 3 or shape[0] < 1 or shape[1] % k or (end - start) % (shape[0] * k):
        raise ModelError(
            f"{where}: {name} has the shape {shape}, not (experts, rows, columns) with rows "
            f"that split evenly into {'/'.join(projections)}; convert the model again"
        )
    part = (end - start) // (shape[0] * k)  # bytes of one expert's one projection
    rows = [shape[1] // k, *shape[2:]]
    for e in range(shape[0]):
        for j, p in enumerate(projections):
            lo = start + (e * k + j) * part
            yield (e, p), {"dtype": info["dtype"], "shape": rows, "data_offsets": [lo, lo + part]}


def check_shapes(config, files: WeightFiles) -> None:
    """Refuse a config.json that does not describe its weights (layer count, embedding and
    attention shapes), in one line, before an engine sizes buffers from it."""
    where = files.folder / "config.json"
    layers = config.num_hidden_layers
    prefix = "model.layers."
    present = {
        int(n[len(prefix) :].split(".", 1)[0]) for n in files.tensor_shard if n.startswith(prefix)
    }
    if len(present) != layers or present != set(range(layers)):
        found = f"layers 0-{max(present)}" if present else "no decoder layers"
        raise ModelError(
            f"{where}: num_hidden_layers is {layers} but the weights hold {found}; the config and "
            "the safetensors do not belong together: fetch or import the model again"
        )
    expected = {"model.embed_tokens.weight": [config.vocab_size, config.hidden_size]}
    expected |= {  # layer 0's linears, as the family holds them (Phi-3's fused qkv_proj, ...)
        f"model.layers.0.{m}.weight": [out, n] for m, (n, out) in config.linear_shapes().items()
    }
    for name, shape in expected.items():
        if name not in files.tensor_shard:
            raise ModelError(
                f"{files.folder}: no tensor {name}; not an HF-layout Llama/Qwen2 model"
            )
        module = name.removesuffix(".weight")
        if f"{module}.scales" in files.tensor_shard:
            shape = quantized_shape(config, files, module, shape)
        actual = files.tensor_info(name).get("shape")
        if actual != shape:
            raise ModelError(
                f"{where}: says {name} is {shape} but the weights hold {actual}; the config and "
                "the safetensors do not belong together: fetch or import the model again"
            )


def quantized_shape(config, files: WeightFiles, module: str, shape: list[int]) -> list[int]:
    """The packed weight shape of a quantized ``module`` whose float shape is ``shape``, after
    checking that config.json declares its quantization and its scales and biases fit it."""
    where = files.folder / "config.json"
    if not config.quantization:
        raise ModelError(
            f"{where}: {module} is quantized but config.json has no quantization; "
            "re-import or re-quantize the model"
        )
    bits, group = config.quant_spec(module)
    groups = [shape[0], shape[1] // group]
    for part in ("scales", "biases"):
        name = f"{module}.{part}"
        got = files.tensor_info(name).get("shape") if name in files.tensor_shard else None
        if got != groups:
            raise ModelError(
                f"{where}: {bits}-bit groups of {group} give {name} the shape {groups}, the weights "
                f"hold {got}; the config and the safetensors do not belong together"
            )
    return [shape[0], shape[1] * bits // 32]


def quantized_weights(config, files: WeightFiles) -> dict[str, tuple[int, int]]:
    """``{"<module>.weight": (bits, group_size)}`` for every packed weight of the folder (those
    whose ``<module>.scales`` exist, as mlx-lm decides)."""
    out = {}
    for name in files.tensor_shard:
        module = name.removesuffix(".weight")
        if module != name and f"{module}.scales" in files.tensor_shard:
            if not config.quantization:
                raise ModelError(
                    f"{files.folder / 'config.json'}: {module} is quantized but config.json has "
                    "no quantization; re-import or re-quantize the model"
                )
            out[name] = config.quant_spec(module)
    return out


def _nbytes(info: dict) -> int:
    start, end = info["data_offsets"]
    return end - start


def layer_bytes(
    config, files: WeightFiles, itemsize: int, computes_packed=None, routed: bool = True
) -> int:
    """Bytes of the largest decoder layer as a ring slot holds it (``tensors_bytes``), its
    routed experts left out unless ``routed``. A float folder's is ``layer_params() * itemsize``."""
    return max(
        tensors_bytes(
            config,
            files,
            [f"model.layers.{i}.{k}" for k in config.layer_keys(i, routed)],
            itemsize,
            computes_packed,
        )
        for i in range(config.num_hidden_layers)
    )


def tensors_bytes(config, files: WeightFiles, names, itemsize: int, computes_packed=None) -> int:
    """Bytes of the tensors ``names`` as the engine holds them: a packed module's weight,
    scales and biases as stored (the packed form), every other tensor at ``itemsize`` bytes a
    value (read into the compute dtype). ``computes_packed(bits, group_size, (out, in))``: the
    compute form instead, where the engine computes on the packed modules it accepts and
    expands the others."""
    total = 0
    for name in names:
        module = name.removesuffix(".weight")
        if module != name and f"{module}.scales" in files.tensor_shard:
            parts = [f"{module}.{p}" for p in ("weight", "scales", "biases")]
            packed = sum(_nbytes(files.tensor_info(n)) for n in parts)
            bits, group = config.quant_spec(module)
            out, words = files.tensor_info(name)["shape"]
            shape = (out, words * 32 // bits)
            if computes_packed is None or computes_packed(bits, group, shape):
                total += packed
            else:
                total += math.prod(shape) * itemsize
        else:
            total += math.prod(files.tensor_info(name)["shape"]) * itemsize
    return total


# It hashes the config, the shard names and sizes, the safetensors headers and every shard's full
# sha256 (a sample of each shard's ends, its definition before, let a file with other weights in the
# middle pass as the genuine one).
def fingerprint(folder: Path, hashes: Mapping[str, str] | None = None) -> str:
    """``sha256:<hex>`` of config.json, shard names and sizes, headers and each shard's sha256:
    from ``hashes`` (shard name -> hex, the cache's records) where given, else hashed here
    (``NotFinite`` for a float tensor holding NaN or inf, found in the same pass)."""
    folder = Path(folder)
    files = weight_files(folder)
    known = hashes or {}
    doc = {
        # bytes, as load_config reads them: json accepts what it accepted (a UTF-8-encoded lone
        # surrogate, which a strict text read refuses with a traceback)
        "config": json.loads((folder / "config.json").read_bytes()),
        "shards": [[s, (folder / s).stat().st_size] for s in files.shards],
        "headers": [files.stored_headers()[s] for s in files.shards],
        "sha256": [known.get(s) or checked_sha256(folder / s) for s in files.shards],
    }
    raw = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(raw).hexdigest()
