"""The compute dtype of base weights on torch, and why.

CUDA computes in bfloat16. A CPU computes in bfloat16 only where a measured linear layer shows
bf16 fast enough (``core.numerics``: interleaved rounds, the fastest of each, a margin before
it flips). The measurement takes well under a second and is kept per machine in
``machine_cache()/numerics-torch.json``, keyed by CPU model and flags and torch version, so it
happens once. Adapters are float32 everywhere; that is not decided here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spill.engines.core.numerics import ROUNDS, SHAPE, measure, verdict
from spill.errors import EngineError
from spill.ground.machine import cached_measurement, cpu_key, cpu_model  # noqa: F401 (tests read it)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
CACHE = "numerics-torch.json"


def measure_linear(shape: tuple[int, int, int] = SHAPE, rounds: int = ROUNDS) -> dict:
    """One linear layer in float32 and in bfloat16 on this CPU, timed interleaved on one thread.

    One thread, because a multi-threaded matmul on a busy machine waits for its slowest thread:
    in one CI run with a busy loop on each of 2 cores, float32's best round on 2 threads went
    13x slower and bf16's 2.5x, and the choice flipped. One thread is slowed by the share of a
    core it gets, the same share for both dtypes."""
    n, k, m = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, k, generator=gen)
    w = torch.randn(m, k, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure(lambda: F.linear(x, w), lambda: F.linear(xb, wb), shape, rounds)
    finally:
        torch.set_num_threads(threads)


def cpu_measurement() -> dict:
    """This machine's measurement, from the cache when present, else measured and cached."""
    # measure_linear is looked up here, at call time, so a test may replace it
    return cached_measurement(CACHE, f"{cpu_key()} | torch {torch.__version__}", measure_linear)


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
    bf16, why = verdict(cpu_measurement())
    return (torch.bfloat16 if bf16 else torch.float32), why


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
