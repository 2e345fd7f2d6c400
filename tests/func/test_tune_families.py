"""``spill tune`` on the Qwen3, Mistral, SmolLM3 and Gemma 3 families (transformers-made folders,
float32, sequences past the sliding windows): a short LoRA run trains, and one stopped with
``--stop-after`` then run again continues to the very checkpoint and adapter of the run that was
never stopped (on torch; and on MLX for Mistral, whose window slides on every layer, and Gemma
3)."""

from __future__ import annotations

import math

import pytest

from tests.func import tune_kit as kit
from tests.unit.engines import hf_families
from tests.unit.engines.kit import load_engine

STEPS = 3


@pytest.mark.parametrize(
    "variant, engine",
    [
        ("qwen3", "torch"),
        ("mistral", "torch"),
        ("smollm3", "torch"),
        ("gemma3", "torch"),
        pytest.param("gemma3", "mlx", marks=pytest.mark.mlx),
        pytest.param("mistral", "mlx", marks=pytest.mark.mlx),
    ],
)
def test_tune_stopped_and_continued_equals_uninterrupted(variant, engine, tmp_path, tiny_models):
    if engine == "mlx":
        load_engine("mlx")  # skips, saying how to install it, where MLX is missing
    model = hf_families.make(variant, tmp_path / variant, tiny_models["llama"])
    train = kit.write_train(tmp_path / "train.jsonl")
    env = kit.spill_env(tmp_path / "home")
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")

    done = kit.run_tune(kit.tune_argv(model, train, whole, steps=STEPS, engine=engine), env)
    assert done.returncode == 0, done.stderr
    assert f" {engine} " in done.stdout.splitlines()[-1]  # the summary row names the engine
    losses = kit.state_json(whole, STEPS)["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) and x > 0 for x in losses)

    stop = kit.tune_argv(model, train, parts, steps=STEPS, stop_after=1, engine=engine)
    first = kit.run_tune(stop, env)
    assert first.returncode == 0, first.stderr
    assert "stopped after step 1 of 3 (--stop-after)" in first.stderr
    again = kit.run_tune(kit.tune_argv(model, train, parts, steps=STEPS, engine=engine), env)
    assert again.returncode == 0, again.stderr
    assert kit.resumed_from(again.stderr, steps=STEPS) == 1
    kit.assert_same_checkpoint(parts, whole, step=STEPS)
    assert kit.adapter_files(parts) == kit.adapter_files(whole)
    assert kit.litter(parts) == []
