import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from spill.errors import SpillError
from spill.models.config import load_config
from spill.models.lora import (
    ALL_LINEAR,
    LoraConfig,
    export_mlx,
    export_peft,
    init_params,
    param_names,
)


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
