import hashlib
import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from spill.errors import SpillError
from spill.models.config import load_config
from spill.models.lora import (
    ALL_LINEAR,
    EXPERT_TARGETS,
    LoraConfig,
    export_mlx,
    export_peft,
    init_params,
    param_names,
)
from spill.models.sources.tiny import write_tiny


def test_targets_parse():
    assert LoraConfig.parse_targets("v_proj,q_proj") == ("q_proj", "v_proj")
    assert LoraConfig.parse_targets("all") == ALL_LINEAR
    with pytest.raises(SpillError, match="unknown LoRA target"):
        LoraConfig.parse_targets("q_proj,wq")


def test_init_is_deterministic_and_shaped(tiny_models):
    cfg = load_config(tiny_models["qwen2"])
    lora = LoraConfig(rank=4, targets=ALL_LINEAR)
    a, b = init_params(cfg, lora, 1), init_params(cfg, lora, 1)
    assert sorted(a) == sorted(param_names(cfg, lora))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert a["layers.0.self_attn.k_proj.lora_a"].shape == (cfg.hidden_size, 4)
    assert a["layers.0.mlp.down_proj.lora_b"].shape == (4, cfg.hidden_size)
    assert not a["layers.1.mlp.up_proj.lora_b"].any()
    assert not np.array_equal(
        a["layers.0.self_attn.q_proj.lora_a"],
        init_params(cfg, lora, 2)["layers.0.self_attn.q_proj.lora_a"],
    )


def test_a_dense_adapter_starts_from_the_bytes_it_always_did(tiny_models):
    """Expert targets changed how names and shapes are found, not a dense model's draws (the
    hash is the init of the code before them)."""
    cfg = load_config(tiny_models["qwen2"])
    params = init_params(cfg, LoraConfig(rank=4, targets=ALL_LINEAR), 1)
    blob = b"".join(k.encode() + v.tobytes() for k, v in params.items())
    assert hashlib.sha256(blob).hexdigest()[:16] == "548accad757b45a4"


def test_expert_targets_put_an_adapter_on_every_expert_and_never_on_the_router(tmp_path):
    """``experts`` is gate_proj, up_proj and down_proj on a model with experts: one adapter on
    every expert's linear of a sparse layer, on the dense MLP of a dense layer; ``all`` stays
    the attention (PEFT's all-linear reaches no expert); a dense family refuses the word."""
    cfg = load_config(write_tiny(tmp_path / "moe", family="qwen3_moe", seed=7))
    attention = LoraConfig.parse_targets("all", cfg.linears, experts=True)
    assert attention == ("q_proj", "k_proj", "v_proj", "o_proj")
    targets = LoraConfig.parse_targets("experts,q_proj", cfg.linears, experts=True)
    assert targets == ("q_proj", *EXPERT_TARGETS)
    with pytest.raises(SpillError, match="choose from q_proj, .*down_proj, 'experts' or 'all'"):
        LoraConfig.parse_targets("gate", cfg.linears, "qwen3_moe", experts=True)
    with pytest.raises(SpillError, match="unknown LoRA target"):
        LoraConfig.parse_targets("experts")
    lora = LoraConfig(rank=4, targets=targets)
    params = init_params(cfg, lora, 1)
    assert list(params) == param_names(cfg, lora)
    last = cfg.experts - 1
    assert params[f"layers.0.mlp.experts.{last}.down_proj.lora_a"].shape == (cfg.expert_size, 4)
    assert params[f"layers.0.mlp.experts.{last}.gate_proj.lora_b"].shape == (4, cfg.expert_size)
    assert len(params) == cfg.num_hidden_layers * 2 * (1 + 3 * cfg.experts)  # all layers sparse
    assert not any(".mlp.gate." in n for n in params)
    # the attention's draws come first in each layer, so layer 0's q_proj is the attention's own
    alone = init_params(cfg, LoraConfig(rank=4, targets=("q_proj",)), 1)
    key = "layers.0.self_attn.q_proj.lora_a"
    assert np.array_equal(params[key], alone[key])


def test_exports(tmp_path, tiny_models):
    cfg = load_config(tiny_models["llama"])
    lora = LoraConfig(rank=2, alpha=4, targets=("q_proj", "v_proj"))
    params = init_params(cfg, lora, 0)
    peft = load_file(
        export_peft(params, lora, "tiny", tmp_path / "peft") / "adapter_model.safetensors"
    )
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    assert np.array_equal(peft[key], params["layers.1.self_attn.q_proj.lora_a"].T)
    mlx = export_mlx(params, lora, cfg.num_hidden_layers, tmp_path / "mlx")
    tensors = load_file(mlx / "adapters.safetensors")
    assert np.array_equal(
        tensors["model.layers.1.self_attn.v_proj.lora_b"],
        params["layers.1.self_attn.v_proj.lora_b"],
    )
    conf = json.loads((mlx / "adapter_config.json").read_text())
    assert conf["lora_parameters"]["scale"] == 2.0 and conf["lora_parameters"]["keys"] == [
        "self_attn.q_proj",
        "self_attn.v_proj",
    ]
