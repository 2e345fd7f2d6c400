"""The compute dtype of base weights, and why.

CUDA computes in bfloat16. A CPU computes in bfloat16 only where a measured linear layer shows
bf16 is at least about as fast as float32 (within 1.5x); CPUs without bf16 instructions run it
~100x slower, others (AVX512-BF16, AMX) faster. The measurement takes well under a second and is
kept per machine in ``machine_cache()/numerics-torch.json``, keyed by CPU model and torch
version, so it happens once. Adapters are float32 everywhere; that is not decided here.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from spill.errors import EngineError
from spill.machine import cached_measurement, cpu_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = 1.5  # bf16 is chosen when its linear takes at most this many times float32's
SHAPE = (64, 1024, 1024)  # (tokens, in, out) of the measured linear
CACHE = "numerics-torch.json"


def _best(fn, reps: int) -> float:
    fn()  # warm-up: kernel selection, page faults
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_linear(shape: tuple[int, int, int] = SHAPE, reps: int = 3) -> dict:
    """Best-of-``reps`` seconds of one linear layer in float32 and in bfloat16 on this CPU."""
    n, k, m = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, k, generator=gen)
    w = torch.randn(m, k, generator=gen)
    f32 = _best(lambda: F.linear(x, w), reps)
    xb, wb = x.bfloat16(), w.bfloat16()
    bf16 = _best(lambda: F.linear(xb, wb), reps)
    return {"shape": list(shape), "float32_s": f32, "bfloat16_s": bf16, "ratio": bf16 / f32}


def cpu_measurement() -> dict:
    """This machine's measurement, from the cache when present, else measured and cached."""
    # measure_linear is looked up here, at call time, so a test may replace it
    return cached_measurement(CACHE, f"{cpu_model()} | torch {torch.__version__}", measure_linear)


def choose(device: torch.device, requested: str | None = None) -> tuple[torch.dtype, str]:
    """(compute dtype, the reason in a few words) for base weights on ``device``."""
    if requested is not None:
        if requested not in DTYPES:
            raise EngineError(f"dtype {requested!r} is not supported; use float32 or bfloat16")
        return DTYPES[requested], "requested"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "CUDA"
        return torch.float32, "CUDA without bf16 support"
    if device.type != "cpu":
        return torch.float32, f"no bf16 measurement for {device.type}"
    ratio = cpu_measurement()["ratio"]
    if ratio <= 1:
        return torch.bfloat16, f"bf16 matmul {1 / ratio:.1f}x faster than float32 here, measured"
    if ratio <= TOLERANCE:
        return torch.bfloat16, f"bf16 matmul within {ratio:.2f}x of float32 here, measured"
    return torch.float32, f"bf16 matmul {ratio:.0f}x slower than float32 here, measured"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
