"""``spill export --format mlx``: the merged model in mlx-lm's layout, as ``mlx_lm.fuse`` writes.

mlx-lm reads HF tensor names and ``config.json``, so the float folder is the hf export's;
``--quantize 4|8`` packs it in mlx-lm's affine layout (``spill.models.quant``: the same bits
as ``mx.quantize``; group size 64, mlx-lm's default) for the tensors ``spill models quantize``
picks (linears, the embedding, an untied head whose rows split into whole groups), scales and
biases in ``--dtype``, with ``quantization`` and ``quantization_config`` in config.json.
"""

from __future__ import annotations

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

    def entries(name: str, w: np.ndarray) -> dict[str, tuple[str, np.ndarray]]:
        code, stored = cast(w, dtype)
        if bits and name.endswith(QUANTIZABLE) and w.ndim == 2 and w.shape[1] % GROUP_SIZE == 0:
            module = name.removesuffix(".weight")
            specs[module] = Spec(bits, GROUP_SIZE)
            return safetensors_entries(module, *affine(stored, bits, GROUP_SIZE), code)
        return {name: (code, stored)}

    n = write_folder(inputs, dest, dtype, progress, shard_bytes, entries)
    config = config_json(inputs, dtype)
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
