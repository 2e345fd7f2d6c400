"""The GGUF writer refuses, in one line and before writing anything, what llama.cpp's
architecture for the family cannot express: a family it has no architecture for, a Gemma 3 off
what llama.cpp's gemma3 fixes in code (sliding layers other than all but every 6th, a local
rotary base other than 10000, a query_pre_attn_scalar other than head_dim), layers that slide (Qwen2/Qwen3's ``use_sliding_window``, Mistral's window: llama.cpp runs them
attending to every key), a Qwen3 with biases, SmolLM3 NoPE layers off llama.cpp's fixed step
(every 4th); the same families without those are written, and a Phi-3's longrope as llama.cpp
reads it, its factors as ``rope_factors_long/short`` (issue 37)."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from spill.errors import UnsupportedModel
from spill.jobs.export.gguf import _refuse_unwritable, rope_tensors, yarn_log_mul
from spill.models.config import parse_config
from spill.models.sources.tiny import write_tiny


def _refusal(cfg) -> str:
    with pytest.raises(UnsupportedModel) as err:
        _refuse_unwritable(SimpleNamespace(config=cfg, base_name="base"))
    assert "\n" not in str(err.value)
    return str(err.value)


def _config(tmp_path, family: str, **keys):
    raw = json.loads((write_tiny(tmp_path / family, family) / "config.json").read_text())
    return parse_config(raw | keys)


def test_a_family_without_a_gguf_form_is_refused(tmp_path):
    said = _refusal(replace(_config(tmp_path, "llama"), family="granite"))
    only = "(only llama, qwen2, qwen3, qwen3_moe, smollm3, phi3, gemma3_text, ministral3, "
    only += "mistral)"
    assert f"no GGUF of a granite model yet {only}" in said


def test_a_gemma3_is_written_where_llama_cpps_gemma3_computes_it(tmp_path):
    """Every 6th layer full (tiny's full layer is every 3rd), the others on base 10000, queries
    scaled by head_dim ** -0.5, no rope scaling."""
    pattern = {"layer_types": None}  # sliding_window_pattern's default, 6
    cfg = _config(tmp_path, "gemma3_text", **pattern)
    assert cfg.windowed == (0, 1, 2, 3) and cfg.query_scale == cfg.head_dim**-0.5
    _refuse_unwritable(SimpleNamespace(config=cfg, base_name="base"))
    said = _refusal(_config(tmp_path / "2", "gemma3_text"))
    assert "its sliding layers [0, 1, 3] are not llama.cpp's gemma3's (all but every 6th)" in said
    said = _refusal(_config(tmp_path / "3", "gemma3_text", rope_local_base_freq=20000.0, **pattern))
    assert "its sliding layers' rotary base 20000 is not llama.cpp's gemma3's (10000)" in said
    head = cfg.head_dim
    said = _refusal(_config(tmp_path / "4", "gemma3_text", query_pre_attn_scalar=20, **pattern))
    assert f"its query_pre_attn_scalar 20 is not the {head} llama.cpp's gemma3 scales" in said
    scaled = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}
    scaled |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    said = _refusal(_config(tmp_path / "5", "gemma3_text", rope_scaling=scaled, **pattern))
    assert "rope scaling on a gemma3_text model has no GGUF form" in said


def test_a_phi3_is_written_with_its_longrope_factors_as_llama_cpp_reads_them(tmp_path):
    cfg = _config(tmp_path, "phi3")  # tiny's phi3 has longrope past 32 positions
    assert cfg.rope_long and cfg.rotary_dim < cfg.head_dim
    _refuse_unwritable(SimpleNamespace(config=cfg, base_name="base"))
    factors = rope_tensors(cfg)
    assert list(factors) == ["rope_factors_long.weight", "rope_factors_short.weight"]
    for got, want in zip(factors.values(), (cfg.rope_long, cfg.rope_short), strict=True):
        assert got.dtype == np.float32 and got.shape == (cfg.rotary_dim // 2,)
        assert np.array_equal(got, np.asarray(want, np.float32))
    cfg = _config(tmp_path / "2", "phi3", rope_scaling=None)
    assert cfg.rotary_dim < cfg.head_dim and not cfg.rope_long and rope_tensors(cfg) == {}
    _refuse_unwritable(SimpleNamespace(config=cfg, base_name="base"))


def test_a_ministral3s_yarn_is_written_where_llama_cpps_mistral3_derives_its_attention_factor(
    tmp_path,
):
    """The attention factor is mscale 1 over mscale_all_dim (llama.cpp's yarn_log_multiplier):
    none given is the factor's own (multiplier 0); an mscale of 2 or truncate false is refused."""
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    yarn |= {"llama_4_scaling_beta": 0.3, "rope_theta": 10000.0}
    cases = ((yarn, 0.0), (yarn | {"mscale": 1.0, "mscale_all_dim": 0.5}, 0.5))
    cases += ((yarn | {"mscale": 1.0, "mscale_all_dim": 1.0}, 1.0),)
    for i, (params, mul) in enumerate(cases):
        cfg = _config(tmp_path / str(i), "ministral3", rope_parameters=params)
        assert cfg.rope_kind == "yarn" and yarn_log_mul(cfg) == mul, (params, cfg.rope_attention)
        _refuse_unwritable(SimpleNamespace(config=cfg, base_name="base"))
    cfg = _config(tmp_path / "m", "ministral3", rope_parameters=yarn | {"mscale": 2.0})
    cfg = replace(cfg, rope_attention=3.0)  # no multiplier gives it
    assert "its YaRN attention factor 3 is not one llama.cpp's mistral3 derives" in _refusal(cfg)
    cfg = _config(tmp_path / "t", "ministral3", rope_parameters=yarn | {"truncate": False})
    assert "YaRN with truncate false has no GGUF form" in _refusal(cfg)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "smollm3"])
def test_the_written_families_pass(family, tmp_path):
    _refuse_unwritable(SimpleNamespace(config=_config(tmp_path, family), base_name="base"))


def test_a_mistral_is_written_without_its_window_only(tmp_path):
    cfg = _config(tmp_path, "mistral")  # tiny's mistral slides (32 keys)
    assert "llama.cpp's llama attends to every key" in _refusal(cfg)
    cfg = _config(tmp_path / "2", "mistral", sliding_window=None)
    _refuse_unwritable(SimpleNamespace(config=cfg, base_name="base"))


def test_a_qwen3_with_biases_and_a_smollm3_off_the_nope_step_are_refused(tmp_path):
    said = _refusal(_config(tmp_path, "qwen3", attention_bias=True))
    assert "biases that a qwen3 GGUF does not hold" in said
    said = _refusal(_config(tmp_path / "2", "smollm3", no_rope_layers=[1, 0, 1, 0]))
    assert "its layers without rotary [1, 3] are not llama.cpp's smollm3's (every 4th)" in said


def test_a_qwen2_with_sliding_layers_is_refused_and_one_without_is_not(tmp_path):
    raw = json.loads((write_tiny(tmp_path / "q", "qwen2") / "config.json").read_text())
    _refuse_unwritable(SimpleNamespace(config=parse_config(raw), base_name="base"))
    raw |= {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    cfg = parse_config(raw)
    assert cfg.windowed == (2, 3)
    assert "sliding-window layers have no GGUF form" in _refusal(cfg)


def test_split_and_fused_linears_get_llama_cpps_names():
    """A Llama's up_proj and a Phi-3's gate_up_proj are both llama.cpp's ffn_up; each keeps it."""
    from spill.jobs.export.gguf import gguf_name

    names = {
        "mlp.up_proj": "ffn_up",
        "mlp.gate_up_proj": "ffn_up",
        "mlp.gate_proj": "ffn_gate",
        "self_attn.qkv_proj": "attn_qkv",
        "self_attn.q_proj": "attn_q",
        "self_attn.q_norm": "attn_q_norm",
    }
    for hf, g in names.items():
        assert gguf_name(f"model.layers.2.{hf}.weight") == f"blk.2.{g}.weight"


def test_gemma3s_norms_get_llama_cpps_gemma3_names():
    """gguf-py's own map for MODEL_ARCH.GEMMA3 (what convert_hf_to_gguf names them by)."""
    import gguf

    from spill.jobs.export.gguf import gguf_name
    from spill.models.gguf.arch import ARCHES

    theirs = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, 3)
    norms = ["input_layernorm", "post_attention_layernorm", "self_attn.q_norm"]
    norms += ["pre_feedforward_layernorm", "post_feedforward_layernorm", "self_attn.k_norm"]
    for norm in norms:
        hf = f"model.layers.2.{norm}.weight"
        assert gguf_name(hf, ARCHES["gemma3"]) == theirs.get_name(hf, try_suffixes=(".weight",))
