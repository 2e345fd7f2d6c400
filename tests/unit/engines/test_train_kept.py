"""Kept activations (one graph over the resident stack) against the recompute walk, on every
engine: the same losses, gradients and adapters bit for bit; the budget's choice and the
``SPILL_ACTIVATIONS`` override; streamed layers always recompute."""

from __future__ import annotations

import numpy as np
import pytest

from spill.engines.core.train import FORCE
from spill.errors import EngineError
from spill.models.config import load_config
from spill.models.lora import ALL_LINEAR, LoraConfig
from tests.unit.engines.kit import batches, equal_states, fresh, nudged, open_runner, tune


def grads(trainer) -> dict[str, np.ndarray]:
    return {n: trainer.kernel.numpy(g) for n, g in trainer.grads.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_kept_activations_train_bit_identically_to_recompute(
    engine, tiny_model, monkeypatch, p, dtype
):
    cfg = load_config(tiny_model)
    lora = LoraConfig(rank=4, alpha=8, dropout=p, targets=ALL_LINEAR)
    runner = open_runner(engine, tiny_model, resident=True, dtype=dtype)
    runs = []
    for mode in ("keep", "recompute"):
        monkeypatch.setenv(FORCE, mode)
        trainer = fresh(runner, cfg, lora, nudged(cfg, lora))
        assert trainer.plan(3, 8).keep == (mode == "keep")
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


def test_kept_and_streamed_tune_identically(engine, tiny_models, monkeypatch):
    folder = tiny_models["qwen2"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, dropout=0.1, targets=("q_proj", "v_proj", "down_proj"))
    monkeypatch.setenv(FORCE, "keep")
    runs = []
    for options in ({"ring": 2}, {"resident": True}):
        runner = open_runner(engine, folder, dtype="float32", **options)
        trainer = fresh(runner, cfg, lora)
        plan = trainer.plan(3, 8)
        assert plan.keep == ("resident" in options)  # streamed layers always recompute
        runs.append((tune(trainer, 3), trainer.state()))
        runner.close()
    assert runs[0][0] == runs[1][0]
    assert equal_states(runs[0][1], runs[1][1])


def test_the_budget_decides(engine, tiny_models, monkeypatch):
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, targets=ALL_LINEAR)
    monkeypatch.delenv(FORCE, raising=False)
    runner = open_runner(engine, folder, resident=True, dtype="float32")
    trainer = fresh(runner, cfg, lora)
    plan = trainer.plan(4, 128)
    assert plan.keep and 0 < plan.need <= plan.budget
    assert "kept" in plan.line() and "budget" in plan.line()
    monkeypatch.setattr(runner.model.kernel, "memory_budget", lambda: plan.need - 1)
    plan = trainer.plan(4, 128)
    assert not plan.keep and "recomputed" in plan.line() and ">" in plan.line()
    monkeypatch.setenv(FORCE, "sometimes")
    with pytest.raises(EngineError, match="keep or recompute"):
        trainer.plan(4, 128)
    runner.close()
