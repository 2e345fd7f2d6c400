"""Qwen3-MoE (issue 41) on every engine against transformers' own ``Qwen3MoeForCausalLM``:
log-probs within 1e-5 and greedy tokens equal to ``generate`` (float32), with a dense layer among
the sparse ones and every other layer sparse; streamed == resident bit for bit; LoRA training on
the attention linears (the default targets) and on every expert's linears (``experts``, the dense
layer's MLP beside them), the streamed walk and kept activations bit for bit alike, an unrouted
expert's gradients exactly zero. Models made by transformers (``MOE``)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import pytest

from tests.unit.engines import hf_families
from tests.unit.engines.kit import adapter_gaps, load_engine, open_runner

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


@pytest.mark.parametrize("targets", ["all", "q_proj,v_proj", "q_proj,experts"])
def test_kept_activations_and_the_recompute_walk_train_bit_identically(engine, variant, targets):
    """LoRA on the attention linears ("all" of an MoE model's targets) or on every expert's
    linears too: the streamed walk and one graph over the resident stack give the same losses
    and state bit for bit."""
    from spill.models.config import load_config
    from spill.models.lora import LoraConfig
    from tests.unit.engines.kit import fresh, nudged
    from tests.unit.engines.kit import tune as tune_steps

    _, folder = variant
    cfg = load_config(folder)
    chosen = LoraConfig.parse_targets(targets, cfg.linears, experts=True)
    attention = {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert set(chosen) <= attention or set(chosen) - attention == {
        "gate_proj",
        "up_proj",
        "down_proj",
    }
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


def test_an_unrouted_expert_gets_exactly_zero_gradients(engine, folders):
    """Expert targets put one adapter on every expert of a sparse layer and on the dense MLP of
    a dense one; a token reaches top-k experts, so the others' A and B gradients are zeros."""
    from spill.engines.base import AdamW, TrainBatch
    from spill.models.config import load_config
    from spill.models.lora import LoraConfig, param_names
    from tests.unit.engines.kit import fresh, nudged

    folder = folders["qwen3_moe"]
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, alpha=8, targets=LoraConfig.parse_targets("experts", (), None, True))
    names = param_names(cfg, lora)
    assert (
        "layers.0.mlp.experts.7.down_proj.lora_b" in names
        and "layers.1.mlp.up_proj.lora_a" in names
    )
    assert not any(".mlp.gate." in n for n in names)
    runner = open_runner(engine, folder, dtype="float32", ring=2)
    trainer = fresh(runner, cfg, lora, nudged(cfg, lora))
    tokens = np.array([[5, 9]], dtype=np.int64)  # one target token: top 2 of 8 experts a layer
    trainer.accumulate(TrainBatch(tokens, np.ones((1, 2), bool), np.array([[False, True]]), 1.0, 0))
    grads = {n: runner.model.kernel.numpy(g) for n, g in trainer.grads.items()}
    before = trainer.state()[0]
    trainer.apply(AdamW(lr=1e-2, step=1, weight_decay=0.0))  # as torch's AdamW on zero grads
    after = trainer.state()[0]
    runner.close()
    assert np.abs(grads["layers.1.mlp.gate_proj.lora_a"]).max() > 0  # the dense layer's MLP
    for layer in cfg.sparse:
        moved = [
            e for e in range(cfg.experts)
            if any(np.any(grads[f"layers.{layer}.mlp.experts.{e}.{p}.lora_{ab}"] != 0)
                   for p in ("gate_proj", "up_proj", "down_proj") for ab in "ab")
        ]  # fmt: skip
        # the first token is no target, but its keys reach the second: 2 tokens x top-2 at most
        assert 1 <= len(moved) <= 2 * cfg.experts_per_token, (layer, moved)
        for e in set(range(cfg.experts)) - set(moved):  # fresh moments, no decay: not moved
            stem = f"layers.{layer}.mlp.experts.{e}.up_proj.lora_"
            assert all(np.array_equal(before[stem + ab], after[stem + ab]) for ab in "ab")


# every layer sparse: PEFT 0.21 maps a Qwen3-MoE's gate_proj/up_proj/down_proj onto the experts,
# so a dense layer's MLP adapter has no PEFT form (export refuses it, tested below)
ALL_SPARSE = (
    hf_families.MOE["qwen3_moe"][0],
    {**hf_families.MOE["qwen3_moe"][1], "mlp_only_layers": []},
)


def test_an_expert_adapter_in_peft_layout_scores_in_peft_as_in_spill(tmp_path, tiny_models):
    """spill's adapter on q_proj and every expert, written in PEFT's ``target_parameters`` form
    and loaded by PEFT onto transformers' Qwen3MoeForCausalLM (experts fused, 3-D): log-probs
    as spill's with the adapter (float32); read back into spill, the same tensors exactly (the
    dropout, training's alone, written as 0: PEFT's ParamWrapper refuses any)."""
    peft = pytest.importorskip("peft")
    from spill.jobs.adapter_files import load_adapter
    from spill.models.config import load_config
    from spill.models.lora import LoraConfig, export_peft
    from tests.unit.engines.kit import nudged
    from tests.unit.engines.test_families import ROWS
    from tests.unit.engines.test_peft_parity import hf_base, hf_log_probs

    folder = hf_families.make("all-sparse", tmp_path / "m", tiny_models["llama"], 3, ALL_SPARSE)
    cfg = load_config(folder)
    assert cfg.sparse == (0, 1, 2)
    targets = ("q_proj", "gate_proj", "up_proj", "down_proj")
    lora = LoraConfig(rank=4, alpha=8, dropout=0.1, targets=targets)
    params = nudged(cfg, lora, seed=3)
    adapter = export_peft(params, lora, str(folder), tmp_path / "peft")
    back = load_adapter(adapter)  # PEFT refuses dropout on experts: written as 0, training's
    assert back.lora == replace(lora, dropout=0.0) and back.params.keys() == params.keys()
    assert all(np.array_equal(back.params[n], params[n]) for n in params)
    theirs = peft.PeftModel.from_pretrained(hf_base(folder), str(adapter)).eval()
    runner = open_runner(load_engine("torch"), folder, ring=2, dtype="float32")
    gaps, moved = adapter_gaps(runner, lora, params, ROWS, partial(hf_log_probs, theirs))
    runner.close()
    print(f"\nPEFT vs spill with an expert adapter: {max(gaps):.3g} (moved {min(moved):.3g})")
    assert max(gaps) <= 1e-5 and min(moved) > 1e-3, (gaps, moved)


def test_peft_layout_refuses_what_its_experts_cannot_hold(folders, tmp_path):
    """A dense layer's MLP adapter beside experts, and gate without up, in one line each."""
    from spill.errors import SpillError
    from spill.models.config import load_config
    from spill.models.lora import LoraConfig, export_peft, init_params

    cfg = load_config(folders["qwen3_moe"])  # layer 1 dense
    both, gate = (
        LoraConfig(rank=2, targets=("gate_proj", "up_proj")),
        LoraConfig(rank=2, targets=("gate_proj",)),
    )
    experts_only = {n: v for n, v in init_params(cfg, gate, 0).items() if ".experts." in n}
    for lora, params, why in (
        (both, init_params(cfg, both, 0), "dense layer's MLP"),
        (gate, experts_only, "target both gate_proj and up_proj"),
    ):
        with pytest.raises(SpillError, match=f"no PEFT layout.*{why}") as e:
            export_peft(params, lora, "m", tmp_path / "peft")
        assert "\n" not in str(e.value) and not (tmp_path / "peft").exists()
