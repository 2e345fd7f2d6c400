"""The PyTorch engine (CPU and CUDA): ``ENGINE.open(model, options)`` returns a ``TorchRunner``.

Opening decides three things once and says why in ``EngineInfo``: the device (``cuda`` when
present, else ``cpu``), the numerics (``numerics.choose``: bf16 on CUDA, measured on a CPU) and
the ring (``common.plan_ring``: forced slots, resident, or as many slots as the memory budget
holds). Embeddings, the final norm and lm_head are always resident; decoder layers stream.
"""

from __future__ import annotations

import torch

from spill.engines.base import EngineInfo, LoadOptions, ModelSpec, Stats
from spill.engines.common import check_layers, plan_model_ring
from spill.engines.torch import numerics
from spill.engines.torch.model import FAMILIES, Model
from spill.engines.torch.ring import Ring, WeightReader, default_budget
from spill.engines.torch.runner import TorchRunner
from spill.errors import EngineError, UnsupportedModel
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
        slots, resident = plan_model_ring(
            cfg, dtype.itemsize, options, lambda: default_budget(device)
        )
        check_layers(model, FAMILIES[cfg.family].layer_keys(cfg), reader.has)
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
