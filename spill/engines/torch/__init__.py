"""The PyTorch engine (CPU and CUDA): ``ENGINE.open(model, options)`` returns a ``TorchRunner``.

Opening decides three things once and says why in ``EngineInfo``: the device (``cuda`` when
present, else ``cpu``), the numerics (``numerics.choose``: bf16 on CUDA, measured on a CPU) and
the ring (``ring.plan_ring``: forced slots, resident, or as many slots as the memory budget
holds). Embeddings, the final norm and lm_head are always resident; decoder layers stream.
"""

from __future__ import annotations

import torch

from spill.engines.base import EngineInfo, LoadOptions, ModelSpec, Stats
from spill.engines.torch import numerics
from spill.engines.torch.model import FAMILIES, Model
from spill.engines.torch.ring import Ring, WeightReader, default_budget, plan_ring
from spill.engines.torch.runner import TorchRunner
from spill.errors import EngineError, ModelError, UnsupportedModel
from spill.models.weights import weight_files

__all__ = ["ENGINE", "TorchEngine", "TorchRunner"]

SMALL_HIDDEN = 256  # below this hidden size a CPU computes on one thread


def pick_device(requested: str | None) -> torch.device:
    if requested is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        raise EngineError(
            f"device {requested!r} is not understood; use cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(
            f"device {requested} asked for, but torch sees no CUDA here; use --device cpu"
        )
    return device


def _check_layers(model: ModelSpec, reader: WeightReader) -> None:
    """Fail at open, by name, rather than when the ring first reaches a missing tensor."""
    cfg = model.config
    keys = FAMILIES[cfg.family].layer_keys(cfg)
    names = [f"model.layers.{i}.{k}" for i in range(cfg.num_hidden_layers) for k in keys]
    missing = [n for n in names if not reader.has(n)]
    if missing:
        raise ModelError(
            f"{model.folder}: tensor {missing[0]!r} is missing ({len(missing)} in all); "
            "fetch the model again"
        )


class TorchEngine:
    name = "torch"

    def open(self, model: ModelSpec, options: LoadOptions) -> TorchRunner:
        cfg = model.config
        if cfg.family not in FAMILIES:
            raise UnsupportedModel(
                f"the torch engine has no {cfg.family!r} family; use llama or qwen2"
            )
        device = pick_device(options.device)
        if device.type == "cpu" and cfg.hidden_size < SMALL_HIDDEN:
            # Per-op work is microseconds here: OpenMP's fork/join between threads costs more
            # than it saves (measured 3.2 s vs 0.47 s for 6 tiny tune steps on 2 loaded cores).
            torch.set_num_threads(1)
        dtype, why = numerics.choose(device, options.dtype)
        reader = WeightReader(weight_files(model.folder), device, dtype)
        layers = cfg.num_hidden_layers
        layer_bytes = cfg.layer_params() * dtype.itemsize
        # Resident parts come out of the default budget; an explicit one is the ring's own.
        head_bytes = cfg.vocab_size * cfg.hidden_size * dtype.itemsize
        head_bytes *= 1 if cfg.tie_word_embeddings else 2
        budget = options.memory
        if budget is None:
            budget = max(0, default_budget(device) - head_bytes)
        slots, resident = plan_ring(layers, layer_bytes, options.ring, options.resident, budget)
        _check_layers(model, reader)
        stats = Stats()
        ring = Ring(
            Model.layer_loader(cfg, reader), layers, slots, resident, stats, device, reader.recycle
        )
        info = EngineInfo(
            engine=self.name,
            device=str(device),
            numerics=numerics.dtype_name(dtype),
            why=why,
            ring=slots,
            layers=layers,
            resident=resident,
        )
        return TorchRunner(Model(cfg, reader, ring), info, stats)


ENGINE = TorchEngine()
