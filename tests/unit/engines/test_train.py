"""The core trainer on every engine: streamed == resident bit for bit (float32 and a bf16 base),
exact re-entry from ``state()``, dropout masks from the seed alone, and bad input refused."""

from __future__ import annotations

import numpy as np
import pytest

from spill.engines.base import AdamW, TrainBatch
from spill.errors import EngineError
from spill.models.config import load_config
from spill.models.lora import ALL_LINEAR, LoraConfig, init_params
from tests.unit.engines.kit import batches, equal_states, fresh, nudged, open_runner, tune


@pytest.mark.parametrize("p", [0.0, 0.2])
def test_streamed_and_resident_train_bit_identically(engine, tiny_model, p):
    cfg = load_config(tiny_model)
    lora = LoraConfig(rank=4, alpha=8, dropout=p, targets=ALL_LINEAR)
    states, losses = [], []
    for options in ({"ring": 2}, {"resident": True}):
        runner = open_runner(engine, tiny_model, dtype="float32", **options)
        trainer = fresh(runner, cfg, lora)
        losses.append(tune(trainer, 3))
        states.append(trainer.state())
        if "ring" in options:
            assert runner.model.ring.max_live <= 2
        runner.close()
    assert losses[0] == losses[1]
    assert equal_states(*states)
    params, m, v = states[0]
    assert all(x.dtype == np.float32 for d in states[0] for x in d.values())
    assert any(np.abs(params[n]).max() > 0 for n in params if n.endswith("lora_b"))
    assert losses[0][-1] < losses[0][0]


def test_state_round_trip_continues_exactly(engine, tiny_models):
    folder = tiny_models["qwen2"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, dropout=0.1, targets=("q_proj", "v_proj", "down_proj"))
    runner = open_runner(engine, folder, ring=2, dtype="float32")
    whole = fresh(runner, cfg, lora)
    whole_losses = tune(whole, 4)
    first = fresh(runner, cfg, lora)
    losses = tune(first, 2)
    saved = first.state()
    again = runner.trainer(lora)
    again.set_state(*saved)
    assert equal_states(again.state(), saved)  # state() is an exact copy of what was set
    losses += tune(again, 2, start=2)
    assert losses == whole_losses
    assert equal_states(again.state(), whole.state())
    saved[0][next(iter(saved[0]))][:] = 5.0  # the trainer holds its own copies
    assert not equal_states(again.state(), saved)
    runner.close()


def test_dropout_masks_depend_on_the_seed_only(engine, tiny_models):
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    runner = open_runner(engine, folder, ring=2, dtype="float32")
    lora = LoraConfig(rank=4, alpha=8, dropout=0.5, targets=("q_proj", "v_proj"))
    params = nudged(cfg, lora)
    batch = batches(0)[0]

    def loss(seed, p=lora):
        t = fresh(runner, cfg, p, params)
        return t.accumulate(TrainBatch(batch.tokens, batch.attention, batch.targets, 1.0, seed))

    assert loss(3) == loss(3)
    assert loss(3) != loss(4)
    assert loss(3, LoraConfig(rank=4, alpha=8, targets=lora.targets)) != loss(3)
    runner.close()


def test_trainer_refuses_bad_input(engine, tiny_models):
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    runner = open_runner(engine, folder, ring=2, dtype="float32")
    lora = LoraConfig(rank=2, targets=("q_proj",))
    batch = batches(0)[0]
    with pytest.raises(EngineError, match="set_state"):
        runner.trainer(lora).accumulate(batch)
    trainer = fresh(runner, cfg, lora)
    with pytest.raises(EngineError, match="padding"):
        trainer.accumulate(TrainBatch(batch.tokens, batch.attention, ~batch.attention, 1.0, 0))
    with pytest.raises(EngineError, match="missing"):
        trainer.set_state(init_params(cfg, LoraConfig(rank=2, targets=("k_proj",)), 0), {}, {})
    with pytest.raises(EngineError, match="dropout"):
        runner.trainer(LoraConfig(dropout=1.0))
    with pytest.raises(EngineError, match="steps count from 1"):
        trainer.apply(AdamW(lr=1e-3, step=0))
    no_targets = TrainBatch(batch.tokens, batch.attention, batch.targets & False, 1.0, 0)
    assert trainer.accumulate(no_targets) == 0.0
    runner.close()


def test_bfloat16_base_trains_float32_adapters_identically_streamed_and_resident(
    engine, tiny_models
):
    folder = tiny_models["qwen2"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, dropout=0.1, targets=("q_proj", "v_proj", "down_proj"))
    runs = []
    for options in ({"ring": 2}, {"resident": True}):
        runner = open_runner(engine, folder, dtype="bfloat16", **options)
        trainer = fresh(runner, cfg, lora)
        runs.append((tune(trainer, 2), trainer.state()))
        runner.close()
    assert runs[0][0] == runs[1][0]
    assert equal_states(runs[0][1], runs[1][1])
    assert all(x.dtype == np.float32 for d in runs[0][1] for x in d.values())
