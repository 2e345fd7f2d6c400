"""``spill tune`` on Phi-3 (issue 37; a transformers-made folder pretrained on 16 positions, so
the tune's rows turn by longrope's long factors, with a window of 7): a run on its fused linears
stopped with ``--stop-after`` and run again continues to the very checkpoint and adapter of the run
never stopped, on torch and on MLX; and the default targets (q_proj, v_proj), which a Phi-3 does
not have, are refused in one line before anything is written."""

from __future__ import annotations

import math

import pytest

from tests.func import tune_kit as kit
from tests.unit.engines import hf_families
from tests.unit.engines.kit import load_engine

STEPS = 3


@pytest.mark.parametrize("engine", ["torch", pytest.param("mlx", marks=pytest.mark.mlx)])
def test_tune_stopped_and_continued_equals_uninterrupted(engine, tmp_path, tiny_models):
    if engine == "mlx":
        load_engine("mlx")  # skips, saying how to install it, where MLX is missing
    model = hf_families.make("phi3-long", tmp_path / "phi3", tiny_models["llama"])
    train = kit.write_train(tmp_path / "train.jsonl")
    env = kit.spill_env(tmp_path / "home")
    whole, parts = str(tmp_path / "whole"), str(tmp_path / "parts")
    over = {"steps": STEPS, "engine": engine, "targets": "qkv_proj,gate_up_proj,down_proj"}

    done = kit.run_tune(kit.tune_argv(model, train, whole, **over), env)
    assert done.returncode == 0, done.stderr
    state = kit.state_json(whole, STEPS)
    assert state["adapter"]["targets"] == ["qkv_proj", "gate_up_proj", "down_proj"]
    assert len(state["losses"]) == STEPS and all(math.isfinite(x) for x in state["losses"])

    first = kit.run_tune(kit.tune_argv(model, train, parts, stop_after=1, **over), env)
    assert first.returncode == 0, first.stderr
    again = kit.run_tune(kit.tune_argv(model, train, parts, **over), env)
    assert again.returncode == 0, again.stderr
    assert kit.resumed_from(again.stderr, steps=STEPS) == 1
    kit.assert_same_checkpoint(parts, whole, step=STEPS)
    assert kit.adapter_files(parts) == kit.adapter_files(whole)


def test_targets_a_phi3_does_not_have_are_refused_in_one_line(tmp_path, tiny_models):
    model = hf_families.make("phi3", tmp_path / "phi3", tiny_models["llama"])
    train = kit.write_train(tmp_path / "train.jsonl")
    state = tmp_path / "state"
    argv = kit.tune_argv(model, train, str(state), targets=None)  # the default: q_proj,v_proj
    done = kit.run_tune(argv, kit.spill_env(tmp_path / "home"))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0] == (
        "spill: error: unknown LoRA target(s) of a phi3 model ['q_proj', 'v_proj']; choose from "
        "qkv_proj, o_proj, gate_up_proj, down_proj or 'all'"
    )
    assert not list(state.rglob("*.safetensors"))
