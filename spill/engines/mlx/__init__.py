"""The MLX engine (Apple silicon GPU; Linux and macOS CPU): ``ENGINE.open(model, options)``.

Opening decides what the torch engine decides, once, and says why in ``EngineInfo``: the device
(``gpu`` where MLX has one, else ``cpu``), the numerics (``numerics.choose``: bf16 on a GPU,
measured on a CPU, with the BLAS named) and the ring (``ring.plan_ring``). Embeddings, the final
norm and lm_head are resident; decoder layers stream. Importing this package first loads an
optimized BLAS where one is installed (``blas.preload``), which only works before ``mlx.core``.
"""

from __future__ import annotations

from spill.engines.mlx import blas

blas.preload()  # before anything imports mlx.core

import mlx.core as mx  # noqa: E402

from spill.engines.base import EngineInfo, LoadOptions, ModelSpec, Stats  # noqa: E402
from spill.engines.mlx import numerics  # noqa: E402
from spill.engines.mlx.model import FAMILIES, Model  # noqa: E402
from spill.engines.mlx.ring import Ring, WeightReader, default_budget, plan_ring  # noqa: E402
from spill.engines.mlx.runner import MLXRunner  # noqa: E402
from spill.errors import EngineError, ModelError, UnsupportedModel  # noqa: E402
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
        itemsize = dtype.size
        reader = WeightReader(weight_files(model.folder), dtype)
        layers = cfg.num_hidden_layers
        layer_bytes = cfg.layer_params() * itemsize
        # Resident parts come out of the default budget; an explicit one is the ring's own.
        head_bytes = cfg.vocab_size * cfg.hidden_size * itemsize
        head_bytes *= 1 if cfg.tie_word_embeddings else 2
        budget = options.memory
        if budget is None:
            budget = max(0, default_budget() - head_bytes)
        slots, resident = plan_ring(layers, layer_bytes, options.ring, options.resident, budget)
        _check_layers(model, reader)
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
