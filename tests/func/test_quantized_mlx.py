"""``spill tune`` and scoring on the MLX engine on quantized bases, through the real CLI: a tiny
llama quantized by ``spill models quantize`` tunes streamed and resident to the same checkpoint
bits, and a run on it moves between torch and MLX both ways; SmolLM2's kept Q4_1 import scores
the same bits streamed and resident on MLX and within the measured distance of torch."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from spill.payloads.checkpoint import PARAMS
from tests.conftest import run_spill
from tests.func import tune_kit as kit

pytestmark = [
    pytest.mark.mlx,
    pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="MLX is not installed"),
]
STEPS, ACCUM = kit.STEPS, kit.ACCUM
# torch vs MLX on SmolLM2@q4_1 in float32, per-token log-probs of 4 short chat answers:
# measured 1.7e-4 (30 layers of float32 rounding in two engines' orders; the tiny models give
# 1e-6..6e-6), 3x margin
SMOLLM2_LOGPROB = 5e-4


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    base = tmp_path_factory.mktemp("q-mlx")
    env = kit.spill_env(base / "home", OMP_NUM_THREADS="1")
    done = run_spill("models", "quantize", "tiny:llama:1", "--bits", "4", "--group-size", "32",
                     base=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return base, env, done.stdout.strip().splitlines()[-1], kit.write_train(base / "train.jsonl")


def _argv(model, train, state, engine, **over):
    return kit.tune_argv(model, train, state, engine=engine, dropout=0, **over)


def _params(state):
    return kit.tensors(kit.files(state, STEPS)[PARAMS])


def test_mlx_tune_on_a_quantized_tiny_model_streamed_equals_resident(quantized):
    """Every training product has >= DENSE_ROWS rows: dequantized per use on a CPU."""
    from spill.engines.mlx.ops import DENSE_ROWS

    base, env, model, train = quantized
    states = {}
    words = f"weights 4-bit affine g32, dequantized per use for >= {DENSE_ROWS} rows"
    for mode, over in (("ring", {}), ("resident", {"resident": True})):
        states[mode] = str(base / f"mlx-{mode}")
        argv = _argv(model, train, states[mode], "mlx", device="cpu", **over)
        done = kit.run_tune(argv, env)
        assert done.returncode == 0, done.stderr
        assert "engine mlx" in done.stderr and words in done.stderr
    ring, resident = (_params(states[m]) for m in ("ring", "resident"))
    assert sorted(ring) == sorted(resident)
    assert all(ring[k].dtype == np.float32 and np.array_equal(ring[k], resident[k]) for k in ring)
    losses = kit.state_json(states["ring"], STEPS)["losses"]
    assert losses == kit.state_json(states["resident"], STEPS)["losses"]
    assert losses[-1] < losses[0]
    assert kit.adapter_files(states["ring"]) == kit.adapter_files(states["resident"])


@pytest.mark.parametrize(("first", "then"), [("torch", "mlx"), ("mlx", "torch")])
def test_a_tune_on_the_quantized_base_moves_between_engines(quantized, tmp_path, first, then):
    _, env, model, train = quantized
    clean = str(tmp_path / "clean")
    done = kit.run_tune(_argv(model, train, clean, then), env)
    assert done.returncode == 0, done.stderr
    state = str(tmp_path / "moved")
    stop = kit.run_tune(_argv(model, train, state, first, stop_after=3), env)
    assert stop.returncode == 0, stop.stderr
    done = kit.run_tune(_argv(model, train, state, then), env)
    assert done.returncode == 0, done.stderr
    assert kit.resumed_from(done.stderr, STEPS, ACCUM) == 3
    doc = kit.state_json(state, STEPS)
    ranges = [(p["from_step"], p["to_step"], p["engine"]) for p in doc["producers"]]
    assert ranges == [(0, 3, first), (3, STEPS, then)]
    # the float engines' rounding distance (test_cross_engine pins 2.4e-6 relative on losses)
    np.testing.assert_allclose(doc["losses"], kit.state_json(clean, STEPS)["losses"], rtol=1e-5)
    moved, ref = _params(state), _params(clean)
    for k in ref:
        np.testing.assert_allclose(moved[k], ref[k], rtol=1e-4, atol=1e-6)
