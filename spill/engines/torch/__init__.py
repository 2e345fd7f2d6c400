"""The PyTorch engine (CPU and CUDA): ``ENGINE.open(model, options)`` returns a ``StreamRunner``.

The engine places the model and says why in ``EngineInfo``: the device (``cuda`` when present,
else ``cpu``) and the numerics (``numerics.choose``: bf16 on CUDA, measured on a CPU). The ring,
generation, scoring and training are ``spill.engines.core``'s, over ``kernel.TorchKernel``.
"""

from __future__ import annotations

import torch

from spill import console
from spill.engines.base import LoadOptions, ModelSpec, TuneShape
from spill.engines.core import heap
from spill.engines.core.open import SMALL_HIDDEN, Placement, open_runner
from spill.engines.core.runner import StreamRunner
from spill.engines.torch import int4, int4_file, numerics
from spill.engines.torch.kernel import FAMILIES, TorchKernel
from spill.engines.torch.reader import TorchHooks, WeightReader, default_budget
from spill.errors import EngineError
from spill.models.cache import cached_fingerprint
from spill.models.config import ModelConfig
from spill.models.weights import WeightFiles, quantized_weights, weight_files

__all__ = ["ENGINE", "TorchEngine"]


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

    def open(
        self, model: ModelSpec, options: LoadOptions, tune: TuneShape | None = None
    ) -> StreamRunner:
        runner = open_runner(self, model, options, tune)
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
        files = weight_files(folder)
        quantized = quantized_weights(cfg, files)
        kernel, note = _packed_matmul(options, device, cfg, quantized, files)
        derived = None
        if kernel:
            dtype, why = torch.bfloat16, "--packed-matmul"
            fp = cached_fingerprint(folder)
            derived = int4_file.ensure(cfg, files, quantized, fp, console.note)
        else:
            dtype, why = numerics.choose(device, options.dtype)
        name = numerics.dtype_name(dtype)
        return Placement(
            device=device,
            device_name=str(device),
            dtype=dtype,
            numerics=int4.NUMERICS if kernel else name,
            why=why,
            itemsize=dtype.itemsize,
            budget=lambda: default_budget(device),
            reader=WeightReader(files, device, dtype, quantized, derived),
            weights_note=note,
            expands=True,
            computes_packed=int4.accepts if kernel else None,
        )

    def hooks(self, place: Placement, resident: bool) -> TorchHooks:
        # A side stream lets CUDA copies overlap compute on the default stream.
        cuda = place.device.type == "cuda" and not resident
        stream = torch.cuda.Stream(place.device) if cuda else None
        # streamed CPU layers are mapped, not copied; resident ones are read into owned memory.
        # Under a budget they are read too: a mapped slot is page cache the kernel may reclaim at
        # a cgroup's limit before the layer is used, and then reads it again (a 4.6 GiB model in
        # a 1.5 GiB cgroup read 12-14 passes for 8 with 4-7 mapped slots; docs/reports/016)
        mapped = place.device.type == "cpu" and not resident and not place.reader.dropping
        return TorchHooks(place.reader, stream, mapped)

    def kernel(self, cfg: ModelConfig, place: Placement) -> TorchKernel:
        return TorchKernel(cfg, place.reader)


def _packed_matmul(
    options: LoadOptions,
    device: torch.device,
    cfg: ModelConfig,
    quantized: dict,
    files: WeightFiles,
) -> tuple[bool, str]:
    """(whether 4-bit modules compute through the int4 kernel, the pre-run line's note when
    ``--packed-matmul`` was asked for and changes nothing)."""
    if not options.packed_matmul:
        return False, ""
    if device.type != "cpu":
        return False, "--packed-matmul: CPU only, dequantized here"
    if not int4_file.accepted(cfg, files, quantized):
        return False, "--packed-matmul: no 4-bit module the int4 kernel takes, dequantized"
    if options.dtype == "float32":
        raise EngineError(
            "--packed-matmul computes in bfloat16 (torch's int4 kernel takes bf16 activations); "
            "drop --dtype float32, or drop --packed-matmul for float32 numbers"
        )
    return True, ""


ENGINE = TorchEngine()
