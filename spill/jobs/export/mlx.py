"""``spill export --format mlx``: the merged model in mlx-lm's layout, as ``mlx_lm.fuse`` writes.

mlx-lm reads HF tensor names and ``config.json``, so the float folder is the hf export's, with the
keys mlx-lm reads that transformers 5 does not write (``mlx_lm_keys``); ``--quantize 4|8`` packs it
in mlx-lm's affine layout (``spill.models.quant``: the same bits as ``mx.quantize``; group size 64)
for the tensors ``spill models quantize`` picks (linears, the embedding, an untied head whose rows
split into whole groups; an MoE layer's experts as mlx-lm's ``switch_mlp`` stacks, a layer's
experts held until the last one comes), with ``quantization`` and ``quantization_config``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import numpy as np

from spill.errors import SpillError
from spill.jobs.export.hf import SHARD_BYTES, cast, config_json, write_config, write_folder
from spill.jobs.export.merge import Inputs
from spill.models.quant import Spec, config_entry, safetensors_entries
from spill.models.quant import quantize as affine
from spill.models.sources.quantize import QUANTIZABLE

GROUP_SIZE = 64
EXPERT = re.compile(r"(model\.layers\.\d+\.mlp)\.experts\.\d+\.(\w+)\.weight")


def mlx_lm_keys(inputs: Inputs) -> dict:
    """The keys mlx-lm 0.32 reads that transformers 5 does not write (a top-level
    ``rope_theta``, an explicit ``head_dim``, an MoE's ``num_experts``), where config.json lacks
    them; spill reads the folder the same with or without them."""
    cfg, raw = inputs.config, inputs.raw_config
    keys = {"rope_theta": cfg.rope_theta, "head_dim": cfg.head_dim}
    keys |= {"num_experts": cfg.experts} if cfg.experts else {}
    return {k: v for k, v in keys.items() if k not in raw}


def write(
    inputs: Inputs,
    dest: Path,
    dtype: str,
    quantize: str | None,
    progress: Callable[[str], object],
    shard_bytes: int = SHARD_BYTES,
) -> dict:
    """Fill ``dest`` with the mlx-lm folder; what export.json adds."""
    specs: dict[str, Spec] = {}
    bits = int(quantize) if quantize else None
    held: dict[str, list[np.ndarray]] = {}  # switch_mlp module -> its experts so far

    def entries(name: str, w: np.ndarray) -> dict[str, tuple[str, np.ndarray]]:
        code, stored = cast(w, dtype)
        group = w.shape[-1] % GROUP_SIZE == 0
        expert = EXPERT.fullmatch(name) if bits else None
        if expert:  # held until every expert's projection came (plan: experts in order)
            module = f"{expert[1]}.switch_mlp.{expert[2]}"
            held.setdefault(module, []).append(stored)
            if len(held[module]) < inputs.config.experts:
                return {}
            stack = held.pop(module)
            if not group:
                return {f"{module}.weight": (code, np.stack(stack))}
            specs[module] = Spec(bits, GROUP_SIZE)
            parts = zip(*(affine(x, bits, GROUP_SIZE) for x in stack), strict=True)
            return safetensors_entries(module, *(np.stack(p) for p in parts), code)
        if bits and name.endswith(QUANTIZABLE) and w.ndim == 2 and group:
            module = name.removesuffix(".weight")
            specs[module] = Spec(bits, GROUP_SIZE)
            return safetensors_entries(module, *affine(stored, bits, GROUP_SIZE), code)
        return {name: (code, stored)}

    n = write_folder(inputs, dest, dtype, progress, shard_bytes, entries)
    config = config_json(inputs, dtype) | mlx_lm_keys(inputs)
    if bits:
        if not specs:
            raise SpillError(
                f"{inputs.base_name}: no weight's rows split into groups of {GROUP_SIZE}, so "
                "nothing can be quantized; export it without --quantize"
            )
        config["quantization"] = config_entry(specs)
        config["quantization_config"] = config["quantization"]
    write_config(dest, config)
    what = f"{len(specs)} tensors {bits}-bit g{GROUP_SIZE}" if bits else "float"
    return {"shards": n, "mlx": {"quantized": what}}
