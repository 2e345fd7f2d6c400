"""The bf16 choice from a measurement: interleaved rounds, the fastest of each dtype, a close
call kept in float32, a busy machine named; and the same choice on a loaded machine as on a
quiet one (real processes: a busy loop on every core beside the measurement)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from spill.engines.core import numerics


def _runs(f32: list[float], bf16: list[float]):
    """Two callables that take the given seconds, one per call (the first call: warm-up)."""

    def sleeper(times):
        it = iter([0.0, *times])

        def run():
            time.sleep(next(it))

        return run

    return sleeper(f32), sleeper(bf16)


def test_the_fastest_round_of_each_decides_and_the_order_alternates():
    f32, bf16 = _runs([0.02] * 3, [0.004, 0.05, 0.004])  # one bf16 round hit by a busy moment
    m = numerics.measure(f32, bf16, (1, 1, 1), rounds=3)
    assert m["ratio"] == pytest.approx(0.2, rel=0.5) and m["rounds"] == 3
    assert m["spread"] > numerics.DISTURBED
    bf16_chosen, why = numerics.verdict(m)
    assert bf16_chosen and "faster than float32" in why and "busy machine" in why


@pytest.mark.parametrize(
    "ratio, bf16, says",
    [
        (0.25, True, "4.0x faster"),
        (1.1, True, "within 1.10x"),
        (1.3, False, "too close to call"),
        (1.8, False, "too close to call"),
        (2.5, False, "2x slower"),
        (97.0, False, "97x slower"),
    ],
)
def test_a_close_call_keeps_float32(ratio, bf16, says):
    got, why = numerics.verdict({"ratio": ratio, "spread": 1.1})
    assert got is bf16 and says in why and "busy" not in why


def _choice(env: dict) -> dict:
    code = (
        "import json, torch\n"
        "from spill.engines.core.numerics import verdict\n"
        "from spill.engines.torch.numerics import measure_linear\n"
        "torch.set_num_threads(2)\n"
        "m = measure_linear()\n"
        "print(json.dumps({'bf16': verdict(m)[0], **m}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def test_a_loaded_machine_chooses_as_a_quiet_one(tmp_path):
    env = {**os.environ, "SPILL_MACHINE_CACHE": str(tmp_path)}
    quiet = _choice(env)
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        time.sleep(0.5)
        loaded = _choice(env)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    near = numerics.TOLERANCE / numerics.MARGIN**2, numerics.TOLERANCE * numerics.MARGIN**2
    if near[0] < quiet["ratio"] < near[1]:
        pytest.skip(f"this CPU measures near the threshold (ratio {quiet['ratio']:.2f})")
    print(f"\nquiet {quiet}\nloaded {loaded}")
    assert loaded["bf16"] == quiet["bf16"]
