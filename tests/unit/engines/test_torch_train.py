"""LoRA training through the ring: streamed == resident bit for bit, gradients equal plain
autograd, exact re-entry from ``state()``, and adapters applied to scoring and generation."""

from __future__ import annotations

import numpy as np
import pytest

from spill.engines.base import GenerateParams, LoadOptions, ModelSpec
from spill.engines.torch import ENGINE
from spill.errors import EngineError
from spill.models.config import load_config
from spill.models.lora import LoraConfig, init_params

PROMPTS = [np.array([5, 6, 7, 8, 9, 10]), np.array([100, 3])]
COMPLETIONS = [np.array([11, 12, 13]), np.array([4, 5, 6, 7])]


def open_runner(folder, **options):
    return ENGINE.open(ModelSpec(folder, load_config(folder)), LoadOptions(**options))


def nudged(cfg, lora, seed=0):
    """An adapter with nonzero B, so it changes the model."""
    params = init_params(cfg, lora, seed)
    rng = np.random.default_rng(seed)
    for name, value in params.items():
        if name.endswith("lora_b"):
            params[name] = rng.normal(0, 0.05, value.shape).astype(np.float32)
    return params


def same(xs, ys) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(xs, ys, strict=True))


def test_use_adapter_changes_scores_and_none_restores_the_base(tiny_model):
    runner = open_runner(tiny_model, ring=2, dtype="float32")
    resident = open_runner(tiny_model, resident=True, dtype="float32")
    cfg = load_config(tiny_model)
    lora = LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    greedy = GenerateParams(max_new_tokens=6)
    base = runner.score(PROMPTS, COMPLETIONS)
    runner.use_adapter(lora, init_params(cfg, lora, 3))  # B = 0: exactly the base model
    assert same(base, runner.score(PROMPTS, COMPLETIONS))
    params = nudged(cfg, lora)
    runner.use_adapter(lora, params)
    tuned = runner.score(PROMPTS, COMPLETIONS)
    assert not any(np.allclose(a, b) for a, b in zip(base, tuned, strict=True))
    params[next(iter(params))][:] = 7.0  # the runner holds its own copy
    assert same(tuned, runner.score(PROMPTS, COMPLETIONS))
    resident.use_adapter(lora, nudged(cfg, lora))  # streamed == resident with an adapter too
    assert same(tuned, resident.score(PROMPTS, COMPLETIONS))
    a, b = runner.generate(PROMPTS, greedy, [0, 0]), resident.generate(PROMPTS, greedy, [0, 0])
    assert [g.tokens.tolist() for g in a] == [g.tokens.tolist() for g in b]
    runner.use_adapter(None, None)
    assert same(base, runner.score(PROMPTS, COMPLETIONS))
    runner.close()
    resident.close()


def test_use_adapter_rejects_other_shapes(tiny_models):
    folder = tiny_models["llama"]
    runner = open_runner(folder, ring=2, dtype="float32")
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, targets=("q_proj",))
    params = init_params(cfg, lora, 0)
    with pytest.raises(EngineError, match="missing"):
        runner.use_adapter(LoraConfig(rank=4, targets=("q_proj", "k_proj")), params)
    with pytest.raises(EngineError, match="shape"):
        runner.use_adapter(LoraConfig(rank=2, targets=("q_proj",)), params)
    runner.close()
