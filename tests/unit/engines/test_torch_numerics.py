"""Numerics: bf16 on a CPU only where measured fast; the measurement is cached per machine."""

from __future__ import annotations

import json

import pytest
import torch

from spill.engines.base import LoadOptions, ModelSpec
from spill.engines.torch import ENGINE, numerics
from spill.errors import EngineError
from spill.ground.paths import machine_cache
from spill.models.config import load_config

CPU = torch.device("cpu")


@pytest.fixture
def fake_measure(monkeypatch):
    """Replace the measurement with one of a chosen ratio; count the calls."""
    calls = []

    def use(ratio):
        def measure():
            calls.append(ratio)
            return {"shape": [1, 1, 1], "float32_s": 1.0, "bfloat16_s": ratio, "ratio": ratio}

        monkeypatch.setattr(numerics, "measure_linear", measure)
        return calls

    return use


def test_slow_bf16_picks_float32_and_is_measured_once(fake_measure):
    calls = fake_measure(97.0)
    assert numerics.choose(CPU) == (
        torch.float32,
        "bf16 matmul 97x slower than float32 here, measured",
    )
    assert numerics.choose(CPU)[0] == torch.float32
    assert len(calls) == 1
    cached = json.loads((machine_cache() / "numerics-torch.json").read_text())
    (key,) = cached
    assert numerics.cpu_model() in key and torch.__version__ in key


@pytest.mark.parametrize("ratio", [0.25, 1.1])
def test_fast_bf16_picks_bfloat16(fake_measure, ratio):
    fake_measure(ratio)
    dtype, why = numerics.choose(CPU)
    assert dtype == torch.bfloat16 and "measured" in why


def test_request_overrides_the_measurement(fake_measure, tiny_models):
    calls = fake_measure(97.0)
    assert numerics.choose(CPU, "bfloat16") == (torch.bfloat16, "requested")
    assert calls == []
    folder = tiny_models["llama"]
    runner = ENGINE.open(ModelSpec(folder, load_config(folder)), LoadOptions(dtype="bfloat16"))
    assert runner.info.numerics == "bfloat16" and runner.model.kernel.embed.dtype == torch.bfloat16
    with pytest.raises(EngineError, match="float32 or bfloat16"):
        numerics.choose(CPU, "float16")


def test_engine_reports_the_measured_choice(fake_measure, tiny_models):
    fake_measure(97.0)
    folder = tiny_models["llama"]
    runner = ENGINE.open(ModelSpec(folder, load_config(folder)), LoadOptions())
    assert runner.info.numerics == "float32"
    assert "97x slower" in runner.info.line()


def test_real_measurement_times_both_dtypes():
    found = numerics.measure_linear()
    assert found["float32_s"] > 0 and found["bfloat16_s"] > 0  # benchmarks time it, tests don't
