"""Choosing the compute dtype of base weights from a measurement, the same way on every engine.

``measure`` times an engine's float32 and bf16 linear interleaved; ``verdict`` turns the timings
into (compute in bf16, the reason in a few words). A CPU computes in bfloat16 only where bf16 is
clearly no slower than float32 allows (``TOLERANCE``); a close call keeps float32 (exact on every
CPU). Each engine times its own linear and keeps the measurement per machine (CPU model and flags,
``spill.ground.machine``); this module times and turns the timings into a choice.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

# CPUs without bf16 instructions run it ~100x slower, others (AVX512-BF16, AMX) faster. The choice
# must not depend on what else the machine does while it measures (one home chose bf16 at ratio
# 0.66, another float32 at 12.0 with jobs running beside it), so:
# - the two dtypes are timed interleaved, ``ROUNDS`` rounds, the order flipping each round, and the
#   fastest time of each is compared: a busy moment slows some rounds, never the best one;
# - a ratio within ``MARGIN`` of ``TOLERANCE`` is a close call, and a close call keeps float32: the
#   choice flips only on a clear difference;
# - rounds of one dtype that vary more than ``DISTURBED`` times mark the measurement as made on a
#   busy machine, which the reason (the pre-run line) says.
TOLERANCE = 1.5  # bf16 is worth it while its linear takes at most about this many times float32's
MARGIN = 1.25  # within this factor of TOLERANCE (1.2 .. 1.875): too close to call, float32
ROUNDS = 7
DISTURBED = 2.0  # one dtype's rounds varying more than this: measured on a busy machine
SHAPE = (64, 1024, 1024)  # (tokens, in, out) of the measured linear


def measure(
    f32: Callable[[], object],
    bf16: Callable[[], object],
    shape: tuple[int, int, int],
    rounds: int = ROUNDS,
) -> dict:
    """Time ``f32()`` and ``bf16()`` (each must finish its work before returning) interleaved,
    ``rounds`` rounds after a warm-up; the fastest of each, their ratio, and how much the
    rounds varied."""
    f32(), bf16()  # warm-up: kernel selection, page faults
    times: dict[str, list[float]] = {"f32": [], "bf16": []}
    for r in range(rounds):
        order = (("f32", f32), ("bf16", bf16)) if r % 2 == 0 else (("bf16", bf16), ("f32", f32))
        for name, run in order:
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    a, b = min(times["f32"]), min(times["bf16"])
    spread = max(max(v) / min(v) for v in times.values())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    out = {"shape": list(shape), "float32_s": a, "bfloat16_s": b, "ratio": b / a}
    out.update(rounds=rounds, spread=round(spread, 3), measured=time.strftime("%Y-%m-%d"))
    if load is not None:
        out["load"] = round(load, 2)
    return out


def verdict(m: dict) -> tuple[bool, str]:
    """(compute in bf16, the reason in a few words) for a measurement (``measure``'s dict)."""
    ratio = m["ratio"]
    if ratio <= 1:
        bf16, why = True, f"bf16 matmul {1 / ratio:.1f}x faster than float32 here, measured"
    elif ratio <= TOLERANCE / MARGIN:
        bf16, why = True, f"bf16 matmul within {ratio:.2f}x of float32 here, measured"
    elif ratio <= TOLERANCE * MARGIN:
        bf16, why = False, f"bf16 matmul {ratio:.2f}x float32's here, too close to call, measured"
    else:
        bf16, why = False, f"bf16 matmul {ratio:.0f}x slower than float32 here, measured"
    if m.get("spread", 1.0) > DISTURBED:
        load = f", load {m['load']:.1f}" if m.get("load") is not None else ""
        why += f" on a busy machine (rounds varied {m['spread']:.1f}x{load})"
    return bf16, why
