"""The compute dtype of base weights on MLX, and why (``choose``).

A GPU (Metal on Apple silicon) computes in bfloat16; that path exists but is untested on the Linux
machines spill is developed on. A CPU computes in bfloat16 only where a measured linear layer shows
bf16 fast enough (``core.numerics.verdict``, as the torch engine), timed in MLX. The measurement is
kept per machine in ``machine_cache()/numerics-mlx.json``, keyed by CPU model and flags, MLX version
and BLAS.
"""

from __future__ import annotations

import mlx.core as mx

from spill.engines.core.numerics import ROUNDS, SHAPE, measure, verdict
from spill.engines.mlx import blas
from spill.errors import EngineError
from spill.ground.machine import cached_measurement, cpu_key

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
CACHE = "numerics-mlx.json"


# On Linux MLX's float32 matmul is BLAS while its bf16 matmul is its own kernel, so the answer
# depends on the BLAS too (see ``blas``): the bundled reference BLAS makes float32 slower than bf16,
# OpenBLAS makes it much faster.
def measure_linear(shape: tuple[int, int, int] = SHAPE, rounds: int = ROUNDS) -> dict:
    """One linear layer in float32 and in bfloat16 on MLX's CPU, timed interleaved."""
    n, k, m = shape
    key = mx.random.key(0)
    with mx.stream(mx.cpu):
        x = mx.random.normal((n, k), key=key)
        w = mx.random.normal((m, k), key=mx.random.split(key)[1])
        xb, wb = x.astype(mx.bfloat16), w.astype(mx.bfloat16)
        mx.eval(x, w, xb, wb)
        return measure(lambda: mx.eval(x @ w.T), lambda: mx.eval(xb @ wb.T), shape, rounds)


def cpu_measurement() -> dict:
    """This machine's measurement, from the cache when present, else measured and cached."""
    # measure_linear is looked up here, at call time, so a test may replace it
    return cached_measurement(
        CACHE, f"{cpu_key()} | mlx {mx.__version__} | {blas.describe()}", measure_linear
    )


def choose(device: mx.Device, requested: str | None = None) -> tuple[mx.Dtype, str]:
    """(compute dtype, the reason in a few words) for base weights on ``device``."""
    where = "" if device == mx.gpu else f"; BLAS {blas.describe()}"
    if requested is not None:
        if requested not in DTYPES:
            raise EngineError(f"dtype {requested!r} is not supported; use float32 or bfloat16")
        return DTYPES[requested], "requested" + where
    if device == mx.gpu:
        return mx.bfloat16, "GPU"
    bf16, why = verdict(cpu_measurement())
    return (mx.bfloat16 if bf16 else mx.float32), why + where


def dtype_name(dtype: mx.Dtype) -> str:
    return {mx.float32: "float32", mx.bfloat16: "bfloat16"}[dtype]
