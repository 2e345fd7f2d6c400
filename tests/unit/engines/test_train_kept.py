"""Kept activations (one graph over the resident stack) against the recompute walk, on every
engine: the same losses, gradients and adapters bit for bit; the budget's choice (within an
explicit ``--memory``) and the ``activations`` setting; streamed layers always recompute."""

from __future__ import annotations

import numpy as np
import pytest

from spill.engines.core.budget import resident_bytes
from spill.errors import EngineError
from spill.models.config import load_config
from spill.models.lora import ALL_LINEAR, LoraConfig
from tests.unit.engines.kit import (
    batches,
    equal_states,
    fresh,
    load_engine,
    nudged,
    open_runner,
    tune,
)


def grads(trainer) -> dict[str, np.ndarray]:
    return {n: trainer.kernel.numpy(g) for n, g in trainer.grads.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_kept_activations_train_bit_identically_to_recompute(engine, tiny_model, p, dtype):
    cfg = load_config(tiny_model)
    lora = LoraConfig(rank=4, alpha=8, dropout=p, targets=ALL_LINEAR)
    runner = open_runner(engine, tiny_model, resident=True, dtype=dtype)
    runs = []
    for mode in ("keep", "recompute"):
        trainer = fresh(runner, cfg, lora, nudged(cfg, lora))
        assert trainer.plan(3, 8, mode).keep == (mode == "keep")
        first = trainer.accumulate(batches(0)[0])
        g = grads(trainer)
        runs.append((first, g, tune(trainer, 3, start=1), trainer.state()))
    (loss_k, g_k, losses_k, state_k), (loss_r, g_r, losses_r, state_r) = runs
    assert loss_k == loss_r
    assert g_k.keys() == g_r.keys()
    for name in g_k:
        assert np.array_equal(g_k[name], g_r[name]), name
    assert any(np.abs(g).max() > 0 for g in g_k.values())
    assert losses_k == losses_r
    assert equal_states(state_k, state_r)
    runner.close()


def test_kept_and_streamed_tune_identically(engine, tiny_models):
    folder = tiny_models["qwen2"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, dropout=0.1, targets=("q_proj", "v_proj", "down_proj"))
    runs = []
    for options in ({"ring": 2}, {"resident": True}):
        runner = open_runner(engine, folder, dtype="float32", **options)
        trainer = fresh(runner, cfg, lora)
        plan = trainer.plan(3, 8, "keep")
        assert plan.keep == ("resident" in options)  # streamed layers always recompute
        runs.append((tune(trainer, 3), trainer.state()))
        runner.close()
    assert runs[0][0] == runs[1][0]
    assert equal_states(runs[0][1], runs[1][1])


def test_the_budget_decides(engine, tiny_models, monkeypatch):
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, targets=ALL_LINEAR)
    runner = open_runner(engine, folder, resident=True, dtype="float32")
    trainer = fresh(runner, cfg, lora)
    plan = trainer.plan(4, 128)
    assert plan.keep and 0 < plan.need <= plan.budget
    assert "kept" in plan.line() and "budget" in plan.line()
    monkeypatch.setattr(runner.model.kernel, "memory_budget", lambda: plan.need - 1)
    plan = trainer.plan(4, 128)
    assert not plan.keep and "recomputed" in plan.line() and ">" in plan.line()
    with pytest.raises(EngineError, match="auto, keep, recompute"):
        trainer.plan(4, 128, "sometimes")
    runner.close()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_streamed_recompute_reusing_forward_outputs_trains_bit_identically(
    engine, tiny_models, family, dtype
):
    """Streamed layers recompute; where the kernel keeps base matmul outputs from the forward
    (torch: every linear but down_proj), the recompute takes them and the bits stay those of a full
    recompute and of kept activations."""
    folder = tiny_models[family]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, dropout=0.2, targets=ALL_LINEAR)
    runs = []
    for options, mode in (
        ({"ring": 2}, "auto"),
        ({"ring": 2}, "recompute"),
        ({"resident": True}, "auto"),
    ):
        runner = open_runner(engine, folder, dtype=dtype, **options)
        trainer = fresh(runner, cfg, lora, nudged(cfg, lora))
        plan = trainer.plan(3, 8, mode)
        reuses = bool(runner.model.kernel.kept_outputs()) and mode == "auto" and "ring" in options
        assert (plan.outputs > 0) == reuses and ("reuses" in plan.line()) == reuses
        first = trainer.accumulate(batches(0)[0])
        runs.append((first, grads(trainer), tune(trainer, 3, start=1), trainer.state()))
        runner.close()
    for loss, g, losses, state in runs[1:]:
        assert loss == runs[0][0] and losses == runs[0][2]
        assert all(np.array_equal(g[n], runs[0][1][n]) for n in g)
        assert equal_states(state, runs[0][3])


def test_forward_outputs_are_reused_only_when_they_fit(tiny_models, monkeypatch):
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    runner = open_runner(load_engine("torch"), folder, ring=2, dtype="float32")
    trainer = fresh(runner, cfg, LoraConfig(rank=4, targets=ALL_LINEAR))
    plan = trainer.plan(4, 128)
    assert not plan.keep and plan.outputs > 0 and "layers stream" in plan.line()
    monkeypatch.setattr(runner.model.kernel, "memory_budget", lambda: plan.outputs - 1)
    assert trainer.plan(4, 128).outputs == 0
    runner.close()


def test_an_explicit_memory_bounds_what_activations_may_take(tiny_models):
    """``--memory`` is the whole budget: what the ring's layers and the trainer's own state
    leave of it is what a step's activations may take (the device's half of available memory
    still caps it)."""
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, targets=ALL_LINEAR)
    layers = cfg.num_hidden_layers * cfg.layer_params() * 4  # float32
    layers += resident_bytes(cfg, 4)  # --memory holds the embeddings and head too
    resident = open_runner(load_engine("torch"), folder, resident=True, dtype="float32")
    trainer = fresh(resident, cfg, lora)
    need, held = trainer.plan(4, 16), trainer.held_bytes()
    assert held == 4 * sum(p.nbytes for p in trainer.params.values())  # params, m, v, grads
    resident.close()
    for extra, keep in ((need.need, True), (need.need - 1, False)):
        memory = layers + held + extra
        runner = open_runner(load_engine("torch"), folder, memory=memory, dtype="float32")
        assert runner.info.resident
        plan = fresh(runner, cfg, lora).plan(4, 16)
        assert plan.keep == keep and plan.budget == extra
        runner.close()
