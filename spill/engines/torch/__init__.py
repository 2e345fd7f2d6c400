"""The PyTorch engine (CPU and CUDA): ``ENGINE.open(model, options)`` returns a ``StreamRunner``.

The engine places the model and says why in ``EngineInfo``: the device (``cuda`` when present,
else ``cpu``) and the numerics (``numerics.choose``: bf16 on CUDA, measured on a CPU). The ring,
generation, scoring and training are ``spill.engines.core``'s, over ``kernel.TorchKernel``.
"""

from __future__ import annotations

import torch

from spill.engines.base import LoadOptions, ModelSpec
from spill.engines.core.open import Placement, open_runner
from spill.engines.core.runner import StreamRunner
from spill.engines.torch import heap, numerics
from spill.engines.torch.kernel import FAMILIES, TorchKernel
from spill.engines.torch.reader import TorchHooks, WeightReader, default_budget
from spill.errors import EngineError
from spill.models.config import ModelConfig
from spill.models.weights import quantized_weights, weight_files

__all__ = ["ENGINE", "TorchEngine"]

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
    families = FAMILIES
    quantized = True  # computes on packed layers, dequantized per use (or once, resident)

    def open(self, model: ModelSpec, options: LoadOptions) -> StreamRunner:
        runner = open_runner(self, model, options)
        if runner.info.device.startswith("cuda"):  # row jobs size their batch from it
            device = torch.device(runner.info.device)
            runner.free_memory = lambda: int(torch.cuda.mem_get_info(device)[0])
        return runner

    def place(self, cfg: ModelConfig, folder, options: LoadOptions) -> Placement:
        device = pick_device(options.device)
        if device.type == "cpu":
            heap.keep_freed_blocks()  # a batch's large temporaries reused, not faulted in anew
        if device.type == "cpu" and cfg.hidden_size < SMALL_HIDDEN:
            # Per-op work is microseconds here: OpenMP's fork/join between threads costs more
            # than it saves (measured 3.2 s vs 0.47 s for 6 tiny tune steps on 2 loaded cores).
            torch.set_num_threads(1)
        dtype, why = numerics.choose(device, options.dtype)
        files = weight_files(folder)
        return Placement(
            device=device,
            device_name=str(device),
            dtype=dtype,
            numerics=numerics.dtype_name(dtype),
            why=why,
            itemsize=dtype.itemsize,
            budget=lambda: default_budget(device),
            reader=WeightReader(files, device, dtype, quantized_weights(cfg, files)),
            expands=True,
        )

    def hooks(self, place: Placement, resident: bool) -> TorchHooks:
        # A side stream lets CUDA copies overlap compute on the default stream.
        cuda = place.device.type == "cuda" and not resident
        stream = torch.cuda.Stream(place.device) if cuda else None
        # streamed CPU layers are mapped, not copied; resident ones are read into owned memory
        return TorchHooks(place.reader, stream, place.device.type == "cpu" and not resident)

    def kernel(self, cfg: ModelConfig, place: Placement) -> TorchKernel:
        return TorchKernel(cfg, place.reader)


ENGINE = TorchEngine()
