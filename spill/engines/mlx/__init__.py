"""The MLX engine (Apple silicon GPU; Linux and macOS CPU): ``ENGINE.open(model, options)``.

The engine places the model and says why in ``EngineInfo``: the device (``gpu`` where MLX has
one, else ``cpu``) and the numerics (``numerics.choose``: bf16 on a GPU, measured on a CPU, with
the BLAS named). The ring, generation, scoring and training are ``spill.engines.core``'s, over
``kernel.MLXKernel``. Importing this package first loads an optimized BLAS where one is installed
(``blas.preload``), which only works before ``mlx.core``.
"""

from __future__ import annotations

from spill.engines.mlx import blas

blas.preload()  # before anything imports mlx.core

import mlx.core as mx  # noqa: E402

from spill.engines.base import LoadOptions, ModelSpec, TuneShape  # noqa: E402
from spill.engines.core.open import SMALL_HIDDEN, Placement, open_runner  # noqa: E402
from spill.engines.core.runner import StreamRunner  # noqa: E402
from spill.engines.mlx import numerics, ops  # noqa: E402
from spill.engines.mlx.kernel import FAMILIES, MLXKernel  # noqa: E402
from spill.engines.mlx.reader import MLXHooks, WeightReader, default_budget  # noqa: E402
from spill.errors import EngineError  # noqa: E402
from spill.models.config import ModelConfig  # noqa: E402
from spill.models.weights import quantized_weights, weight_files  # noqa: E402

__all__ = ["ENGINE", "MLXEngine"]


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


def _weights_note(reader: WeightReader) -> str:
    """The pre-run line's words for how packed weights are computed: dequantized per use for
    many rows on a CPU (``ops.DENSE_ROWS``), group 16 dequantized at load (mlx has no kernel)."""
    words = []
    if reader.dense_rows is not None and len(reader.quantized) > len(reader.dequantized):
        words.append(f"dequantized per use for >= {reader.dense_rows} rows")
    if n := len(reader.dequantized):
        words.append(f"{n} module{'s' if n > 1 else ''} g16 dequantized (mlx takes g32/g64/g128)")
    return ", ".join(words)


class MLXEngine:
    name = "mlx"
    families = FAMILIES
    # mx.quantized_matmul on packed layers, dequantized per use for many rows on a CPU (group 16
    # dequantized on load)
    quantized = True

    def open(
        self, model: ModelSpec, options: LoadOptions, tune: TuneShape | None = None
    ) -> StreamRunner:
        return open_runner(self, model, options, tune)

    def place(self, cfg: ModelConfig, folder, options: LoadOptions) -> Placement:
        device = pick_device(options.device)
        mx.set_default_device(device)  # MLX computes on the process's default device
        if device == mx.cpu:
            # Tiny matrices: a BLAS thread pool's fork/join costs more than it saves.
            blas.set_threads(cfg.hidden_size < SMALL_HIDDEN)
        dtype, why = numerics.choose(device, options.dtype)
        files = weight_files(folder)
        # mlx's CPU quantized kernels are slow on many rows (ops.DENSE_ROWS); Metal's are its fast path
        dense = ops.DENSE_ROWS if device == mx.cpu else None
        reader = WeightReader(files, dtype, quantized_weights(cfg, files), dense)
        return Placement(
            device=device,
            device_name="gpu" if device == mx.gpu else "cpu",
            dtype=dtype,
            numerics=numerics.dtype_name(dtype),
            why=why,
            itemsize=dtype.size,
            budget=default_budget,
            reader=reader,
            weights_note=_weights_note(reader),
        )

    def hooks(self, place: Placement, resident: bool) -> MLXHooks:
        return MLXHooks()

    def kernel(self, cfg: ModelConfig, place: Placement) -> MLXKernel:
        return MLXKernel(cfg, place.reader)


ENGINE = MLXEngine()
