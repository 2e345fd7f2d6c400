"""The MLX engine (Apple silicon GPU; Linux and macOS CPU): ``ENGINE.open(model, options)``.

Opening decides what the torch engine decides, once, and says why in ``EngineInfo``: the device
(``gpu`` where MLX has one, else ``cpu``), the numerics (``numerics.choose``: bf16 on a GPU,
measured on a CPU, with the BLAS named) and the ring (``common.plan_ring``). Embeddings, the final
norm and lm_head are resident; decoder layers stream. Importing this package first loads an
optimized BLAS where one is installed (``blas.preload``), which only works before ``mlx.core``.
"""

from __future__ import annotations

from spill.engines.mlx import blas

blas.preload()  # before anything imports mlx.core

import mlx.core as mx  # noqa: E402

from spill.engines.base import EngineInfo, LoadOptions, ModelSpec, Stats  # noqa: E402
from spill.engines.common import check_layers, plan_model_ring  # noqa: E402
from spill.engines.mlx import numerics  # noqa: E402
from spill.engines.mlx.model import FAMILIES, Model  # noqa: E402
from spill.engines.mlx.ring import Ring, WeightReader, default_budget  # noqa: E402
from spill.engines.mlx.runner import MLXRunner  # noqa: E402
from spill.errors import EngineError, UnsupportedModel  # noqa: E402
from spill.models.weights import weight_files  # noqa: E402

__all__ = ["ENGINE", "MLXEngine", "MLXRunner"]

SMALL_HIDDEN = 256  # below this hidden size OpenBLAS computes on one thread (as torch does)


def pick_device(requested: str | None) -> mx.Device:
    gpu = mx.is_available(mx.gpu)
    if requested is None:
        return mx.Device(mx.gpu if gpu else mx.cpu)
    if requested == "cpu":
        return mx.Device(mx.cpu)
    if requested in ("gpu", "metal", "mps"):
        if not gpu:
            raise EngineError(
                f"device {requested} asked for, but MLX sees no GPU here; use --device cpu"
            )
        return mx.Device(mx.gpu)
    raise EngineError(f"device {requested!r} is not understood by the mlx engine; use cpu or gpu")


class MLXEngine:
    name = "mlx"

    def open(self, model: ModelSpec, options: LoadOptions) -> MLXRunner:
        cfg = model.config
        if cfg.family not in FAMILIES:
            raise UnsupportedModel(
                f"the mlx engine has no {cfg.family!r} family; use llama or qwen2"
            )
        device = pick_device(options.device)
        mx.set_default_device(device)  # MLX computes on the process's default device
        if device == mx.cpu:
            # Tiny matrices: a BLAS thread pool's fork/join costs more than it saves.
            blas.set_threads(cfg.hidden_size < SMALL_HIDDEN)
        dtype, why = numerics.choose(device, options.dtype)
        reader = WeightReader(weight_files(model.folder), dtype)
        layers = cfg.num_hidden_layers
        slots, resident = plan_model_ring(cfg, dtype.size, options, default_budget)
        check_layers(model, FAMILIES[cfg.family].layer_keys(cfg), reader.has)
        stats = Stats()
        ring = Ring(Model.layer_loader(cfg, reader), layers, slots, resident, stats)
        info = EngineInfo(
            engine=self.name,
            device="gpu" if device == mx.gpu else "cpu",
            numerics=numerics.dtype_name(dtype),
            why=why,
            ring=slots,
            layers=layers,
            resident=resident,
        )
        return MLXRunner(Model(cfg, reader, ring), info, stats)


ENGINE = MLXEngine()
