import json

import pytest

from spill.errors import ModelError, UnsupportedModel
from spill.models.config import load_config, parse_config

BASE = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_defaults_and_derived_values():
    c = parse_config(BASE)
    assert c.num_key_value_heads == 4 and c.head_dim == 16
    assert not c.qkv_bias and not c.tie_word_embeddings and c.rope_scaling == ()


def test_qwen2_always_has_qkv_bias():
    assert parse_config({**BASE, "model_type": "qwen2"}).qkv_bias


def test_rope_theta_read_from_rope_parameters():
    c = parse_config({**BASE, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}})
    assert c.rope_theta == 100000.0 and c.rope_scaling == ()


def test_llama3_rope_scaling():
    scaling = {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    for raw in (
        {**BASE, "rope_scaling": scaling, "rope_theta": 5e5},
        {**BASE, "rope_parameters": {**scaling, "rope_theta": 5e5}},
    ):
        c = parse_config(raw)
        assert c.rope_theta == 5e5 and c.rope_scaling_dict["factor"] == 32.0


def test_unsupported_family_and_scaling():
    with pytest.raises(UnsupportedModel, match="model_type 'gpt2'"):
        parse_config({**BASE, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModel, match="yarn"):
        parse_config({**BASE, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


def test_missing_key_and_bad_json(tmp_path):
    with pytest.raises(ModelError, match="missing key 'hidden_size'"):
        parse_config({k: v for k, v in BASE.items() if k != "hidden_size"})
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ModelError, match="not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(ModelError, match="no config.json"):
        load_config(tmp_path / "nope")


def test_layer_params_match_tiny_model(tiny_models):
    from spill.models.weights import weight_files

    for folder in tiny_models.values():
        c = load_config(folder)
        files = weight_files(folder)
        n = sum(
            int(__import__("math").prod(files.tensor_info(name)["shape"]))
            for name in files.tensor_shard
            if name.startswith("model.layers.0.")
        )
        assert n == c.layer_params()
        assert (
            json.loads((folder / "config.json").read_text())["num_hidden_layers"]
            == c.num_hidden_layers
        )
