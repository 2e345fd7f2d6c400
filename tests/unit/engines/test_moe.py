"""Qwen3-MoE (issue 41) on every engine against transformers' own ``Qwen3MoeForCausalLM``:
log-probs within 1e-5 and greedy tokens equal to ``generate`` (float32), with a dense layer among
the sparse ones and every other layer sparse; streamed == resident bit for bit; LoRA training on
the attention linears (the default targets) and on the experts, the streamed walk and kept
activations bit for bit alike. The models are made by transformers (``hf_families.MOE``)."""

from __future__ import annotations

import numpy as np
import pytest

from spill.engines.base import GenerateParams
from tests.unit.engines import hf_families
from tests.unit.engines.kit import PROMPTS, open_runner, same, tokens
from tests.unit.engines.test_families import LONG, NEW, ROWS, hf_log_probs

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


def test_log_probs_match_transformers(engine, variant):
    name, folder = variant
    hf = hf_families.load(folder)
    runner = open_runner(engine, folder, ring=2, dtype="float32")
    got = runner.score(*ROWS)
    for prompt, completion, ours in zip(*ROWS, got, strict=True):
        ref = hf_log_probs(hf, prompt, completion)
        assert np.abs(ours - ref).max() <= 1e-5, name
    runner.close()


def test_greedy_matches_transformers(engine, variant):
    name, folder = variant
    hf = hf_families.load(folder)
    runner = open_runner(engine, folder, ring=2, dtype="float32")
    for prompt in (PROMPTS[0], PROMPTS[2], LONG[0]):
        ours = runner.generate([prompt], GenerateParams(max_new_tokens=NEW), [0])[0]
        out = hf.generate(torch.tensor(prompt)[None], do_sample=False, max_new_tokens=NEW)
        theirs = out[0, len(prompt) :].tolist()
        assert ours.tokens.tolist() == theirs[: len(ours.tokens)], name
    runner.close()


def test_streamed_and_resident_are_bit_identical(engine, variant):
    _, folder = variant
    streamed = open_runner(engine, folder, ring=2, dtype="float32")
    resident = open_runner(engine, folder, resident=True, dtype="float32")
    assert same(streamed.score(*ROWS), resident.score(*ROWS))
    prompts = [*PROMPTS, LONG[0]]
    params = GenerateParams(max_new_tokens=NEW)
    assert tokens(streamed.generate(prompts, params, [0, 1, 2, 3])) == tokens(
        resident.generate(prompts, params, [0, 1, 2, 3])
    )
    streamed.close()
    resident.close()


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
