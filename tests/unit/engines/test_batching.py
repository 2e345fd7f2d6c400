"""The batch-from-budget arithmetic (``spill.engines.core.batching``) and the runner's plan."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spill.engines.core import batching
from spill.engines.core.batching import FALLBACK_BATCH, MAX_BATCH, plan_batch, row_bytes
from spill.models.config import load_config
from tests.unit.engines.kit import open_runner


@pytest.fixture
def cfg(tiny_models):
    return load_config(tiny_models["llama"])


def test_a_row_costs_its_kv_cache_activations_and_logits(cfg):
    t = 100
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * t * 4
    assert row_bytes(cfg, 4, t) > batching.SAFETY * (kv + 2 * cfg.vocab_size * 4)
    assert row_bytes(cfg, 2, t) < row_bytes(cfg, 4, t)
    assert row_bytes(cfg, 4, 2 * t) > row_bytes(cfg, 4, t)
    # attention weights grow with the square of the length
    deeper = replace(cfg, num_hidden_layers=cfg.num_hidden_layers * 2)
    assert row_bytes(deeper, 4, t) > row_bytes(cfg, 4, t)


def test_the_batch_is_what_fits_capped_and_never_more_than_the_rows(cfg):
    need = row_bytes(cfg, 4, 50)
    assert plan_batch(cfg, 4, 50, 1000, 10 * need).rows == 10
    assert "what fits" in plan_batch(cfg, 4, 50, 1000, 10 * need).why
    assert plan_batch(cfg, 4, 50, 1000, 10_000 * need).rows == MAX_BATCH
    assert plan_batch(cfg, 4, 50, 7, 10_000 * need).rows == 7
    assert plan_batch(cfg, 4, 50, 1000, need // 2).rows == 1  # at least one row
    line = plan_batch(cfg, 4, 50, 1000, 10 * need).line()
    assert line.startswith("batch 10 from the memory budget (")


def test_unknown_free_memory_keeps_the_old_fixed_batch(cfg):
    assert plan_batch(cfg, 4, 50, 1000, None).rows == FALLBACK_BATCH
    assert plan_batch(cfg, 4, 50, 3, None).rows == 3
    assert "not known" in plan_batch(cfg, 4, 50, 1000, None).why


def test_the_runner_plans_from_free_memory_less_the_ring(tiny_models):
    from spill.engines.torch import ENGINE

    runner = open_runner(ENGINE, tiny_models["llama"], ring=2, dtype="float32")
    cfg = runner.model.cfg
    need = row_bytes(cfg, 4, 40)
    ring = 2 * cfg.layer_params() * 4
    runner.free_memory = lambda: ring + 2 * 5 * need  # half of what the ring leaves: 5 rows
    assert runner.plan_batch(40, 1000).rows == 5
    runner.free_memory = None  # the host's free memory: plenty for the tiny model
    assert runner.plan_batch(40, 1000).rows == MAX_BATCH
    runner.close()
    resident = open_runner(ENGINE, tiny_models["llama"], resident=True, dtype="float32")
    resident.free_memory = lambda: 2 * 5 * need  # the layers are loaded already: nothing taken
    assert resident.plan_batch(40, 1000).rows == 5
    resident.close()
