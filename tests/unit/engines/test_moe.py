"""Qwen3-MoE (issue 41) on every engine against transformers' own ``Qwen3MoeForCausalLM``:
log-probs within 1e-5 and greedy tokens equal to ``generate`` (float32), with a dense layer among
the sparse ones and every other layer sparse; streamed == resident bit for bit; LoRA training on
the attention linears (the default targets), the streamed walk and kept activations bit for bit
alike (the experts' own adapters: test_moe_mlx_lm). Models made by transformers (``MOE``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.engines import hf_families
from tests.unit.engines.kit import open_runner

# the dense families' tests, run here over MOE's variants (this module's ``variant`` fixture):
# log-probs and greedy tokens against transformers, streamed (experts read as routed) == resident
from tests.unit.engines.test_families import (  # noqa: F401
    test_greedy_matches_transformers,
    test_log_probs_match_transformers,
    test_streamed_and_resident_are_bit_identical,
)

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("hf-moe")
    return {
        v: hf_families.make(v, root / v, tiny_models["llama"], seed=k, spec=hf_families.MOE[v])
        for k, v in enumerate(hf_families.MOE)
    }


@pytest.fixture(params=list(hf_families.MOE))
def variant(request, folders):
    return request.param, folders[request.param]


def test_the_config_says_which_layers_route_and_how(folders):
    from spill.models.config import load_config

    moe = load_config(folders["qwen3_moe"])
    assert (moe.experts, moe.experts_per_token, moe.expert_size) == (8, 2, 48)
    assert moe.sparse == (0, 2) and moe.norm_topk_prob and moe.linears == moe.linears[:4]
    assert "mlp.experts.7.down_proj.weight" in moe.layer_keys(0)
    assert "mlp.gate_proj.weight" in moe.layer_keys(1) and moe.largest_layer == 0
    step = load_config(folders["qwen3_moe-step"])
    assert step.sparse == (1,) and not step.norm_topk_prob and step.qkv_bias


@pytest.mark.parametrize("targets", ["all", "q_proj,v_proj"])
def test_kept_activations_and_the_recompute_walk_train_bit_identically(engine, variant, targets):
    """LoRA on the attention linears ("all" of an MoE model's targets): the streamed walk and
    one graph over the resident stack give the same losses and state bit for bit."""
    from spill.models.config import load_config
    from spill.models.lora import LoraConfig
    from tests.unit.engines.kit import fresh, nudged
    from tests.unit.engines.kit import tune as tune_steps

    _, folder = variant
    cfg = load_config(folder)
    chosen = LoraConfig.parse_targets(targets, cfg.linears)
    assert set(chosen) <= {"q_proj", "k_proj", "v_proj", "o_proj"}
    lora = LoraConfig(rank=4, alpha=8, dropout=0.1, targets=chosen)
    runs = []
    for options, mode in (({"ring": 2}, "auto"), ({"resident": True}, "keep")):
        runner = open_runner(engine, folder, dtype="float32", **options)
        trainer = fresh(runner, cfg, lora, nudged(cfg, lora))
        assert trainer.plan(3, 8, mode).keep == (mode == "keep")
        runs.append((tune_steps(trainer, 3), trainer.state()))
        runner.close()
    (losses_a, state_a), (losses_b, state_b) = runs
    assert losses_a == losses_b and losses_a[-1] < losses_a[0]
    assert all(
        a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)
        for a, b in zip(state_a, state_b, strict=True)
    )
