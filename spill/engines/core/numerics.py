"""Choosing the compute dtype of base weights from a measurement, the same way on every engine.

A CPU computes in bfloat16 only where a measured linear layer shows bf16 at least about as fast
as float32 (within 1.5x): CPUs without bf16 instructions run it ~100x slower, others
(AVX512-BF16, AMX) faster. Each engine times its own linear (``best``) and keeps the result per
machine; this module only turns the ratio into a choice and its reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable

TOLERANCE = 1.5  # bf16 is chosen when its linear takes at most this many times float32's
SHAPE = (64, 1024, 1024)  # (tokens, in, out) of the measured linear


def best(run: Callable[[], object], reps: int) -> float:
    """Best-of-``reps`` seconds of ``run()`` (which must finish its work before returning)."""
    run()  # warm-up: kernel selection, page faults
    fastest = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        run()
        fastest = min(fastest, time.perf_counter() - t)
    return fastest


def timings(f32: float, bf16: float, shape: tuple[int, int, int]) -> dict:
    return {"shape": list(shape), "float32_s": f32, "bfloat16_s": bf16, "ratio": bf16 / f32}


def verdict(ratio: float) -> tuple[bool, str]:
    """(compute in bf16, the reason in a few words) for a measured bf16 / float32 time ratio."""
    if ratio <= 1:
        return True, f"bf16 matmul {1 / ratio:.1f}x faster than float32 here, measured"
    if ratio <= TOLERANCE:
        return True, f"bf16 matmul within {ratio:.2f}x of float32 here, measured"
    return False, f"bf16 matmul {ratio:.0f}x slower than float32 here, measured"
