"""The families' metadata outside the engines (issue 37): every family has a tiny random model
(``spill models tiny --family``, ``tiny:<family>:<seed>``) whose config.json carries what the
family adds (Qwen3's explicit head_dim and q/k norms, Mistral's sliding window, SmolLM3's NoPE
layers), and a GGUF of a family whose llama.cpp names spill does not read is refused in one
line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spill.models.config import FAMILIES, load_config
from spill.models.names import parse_tiny
from spill.models.sources.tiny import TINY_FAMILIES, write_tiny
from tests.conftest import run_spill


def test_every_family_has_a_tiny_model_and_a_tiny_name():
    assert TINY_FAMILIES == tuple(FAMILIES)
    for family in FAMILIES:
        assert parse_tiny(f"tiny:{family}:3:2x32").family == family


def test_the_new_families_tiny_configs_say_what_the_family_adds(tmp_path):
    qwen3 = load_config(write_tiny(tmp_path / "qwen3", "qwen3", seed=1))
    assert qwen3.qk_norm and qwen3.head_dim == 2 * qwen3.hidden_size // qwen3.num_attention_heads
    assert "self_attn.q_norm.weight" in qwen3.layer_keys()
    mistral = load_config(write_tiny(tmp_path / "mistral", "mistral", seed=1))
    assert mistral.sliding_window == 32 and mistral.windowed == (0, 1, 2, 3)
    smollm3 = load_config(write_tiny(tmp_path / "smollm3", "smollm3", seed=1, layers=8))
    assert smollm3.no_rope == (3, 7)


@pytest.mark.parametrize(
    "family", ["qwen3", "qwen3_moe", "mistral", "smollm3", "gemma3_text", "phi3", "ministral3"]
)
def test_spill_models_tiny_writes_the_same_bytes_and_the_engine_runs_it(family, tmp_path):
    out = tmp_path / "cli"
    done = run_spill("models", "tiny", str(out), "--family", family, "--seed", "4", timeout=120)
    assert done.returncode == 0, done.stderr
    again = write_tiny(tmp_path / "api", family, seed=4)
    for f in sorted(p.name for p in again.iterdir()):
        assert (out / f).read_bytes() == (again / f).read_bytes(), f
    assert json.loads((out / "config.json").read_text())["model_type"] == family

    from spill.engines.base import LoadOptions, ModelSpec
    from spill.engines.torch import ENGINE

    runner = ENGINE.open(ModelSpec(out, load_config(out)), LoadOptions(dtype="float32", ring=2))
    (logp,) = runner.score([np.arange(5, 45)], [np.arange(45, 60)])
    assert logp.shape == (15,) and np.isfinite(logp).all() and (logp < 0).all()
    runner.close()


@pytest.mark.parametrize("arch", ["olmo2", "mistral4"])
def test_a_gguf_of_a_family_spill_imports_no_gguf_of_is_refused_in_one_line(arch, tmp_path):
    """A GGUF of an architecture spill does not import is refused before anything is written
    (qwen3, smollm3, phi3 and mistral3 GGUFs import: tests/func/test_export_families.py;
    gemma3's: tests/unit/models/gguf/test_gemma3.py)."""
    from spill.errors import UnsupportedModel
    from spill.models.gguf.importer import import_gguf
    from tests.unit.models.gguf.gguf_bytes import small_llama, small_metadata

    meta = small_metadata()
    meta = {k.replace("llama.", f"{arch}.", 1): v for k, v in meta.items()}
    path = small_llama(tmp_path / "m.gguf", meta | {"general.architecture": arch})
    with pytest.raises(UnsupportedModel) as err:
        import_gguf(path, tmp_path / "out")
    assert "\n" not in str(err.value) and f"GGUF architecture {arch!r} is not supported" in str(
        err.value
    )
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_a_gemma3_gguf_holding_a_llamas_tensors_is_refused_in_one_line(tmp_path):
    """A gemma3 GGUF lacks Gemma's four norms a block when it holds a Llama's tensors: refused
    in one line naming the first missing one, nothing written."""
    from spill.errors import ModelError
    from spill.models.gguf.importer import import_gguf
    from tests.unit.models.gguf.gguf_bytes import small_llama, small_metadata

    meta = {k.replace("llama.", "gemma3.", 1): v for k, v in small_metadata().items()}
    path = small_llama(tmp_path / "m.gguf", meta | {"general.architecture": "gemma3"})
    with pytest.raises(ModelError) as err:
        import_gguf(path, tmp_path / "out")
    assert "\n" not in str(err.value) and "tensors missing (first model.layers.0." in str(err.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_a_qwen3_gguf_needs_its_q_k_norms_and_a_smollm3_gguf_has_llama_cpps_nope_step(tmp_path):
    """A qwen3 GGUF holding a Llama's tensors lacks attn_q_norm/attn_k_norm: refused in one line
    naming the first missing one; a smollm3 GGUF imports as SmolLM3 with llama.cpp's NoPE step
    (every 4th layer; no GGUF key holds it) and its q/k rows unpermuted as a Llama's."""
    from spill.errors import ModelError, UnsupportedModel
    from spill.models.config import load_config
    from spill.models.gguf.importer import import_gguf
    from tests.unit.models.gguf.gguf_bytes import small_llama, small_metadata

    def of(arch: str) -> Path:
        meta = {k.replace("llama.", f"{arch}.", 1): v for k, v in small_metadata().items()}
        return small_llama(tmp_path / f"{arch}.gguf", meta | {"general.architecture": arch})

    with pytest.raises(ModelError) as err:
        import_gguf(of("qwen3"), tmp_path / "q")
    said = str(err.value)
    assert "\n" not in said and "missing (first model.layers.0.self_attn.k_norm.weight)" in said
    assert not (tmp_path / "q").exists()
    llama = import_gguf(small_llama(tmp_path / "llama.gguf"), tmp_path / "l")
    smol = import_gguf(of("smollm3"), tmp_path / "s")
    cfg = load_config(smol)
    assert cfg.family == "smollm3" and cfg.no_rope == () and cfg.num_hidden_layers == 1
    assert (smol / "model.safetensors").read_bytes() == (llama / "model.safetensors").read_bytes()
    with pytest.raises(UnsupportedModel) as err:  # a phi3 holds attn_qkv, not split matrices
        import_gguf(of("phi3"), tmp_path / "p")
    assert "tensor blk.0.attn_q.weight is not part of a plain phi3 model" in str(err.value)


def _raw(model_type: str, **keys) -> dict:
    base = {
        "model_type": model_type,
        "vocab_size": 300,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
    }
    return base | keys


def test_each_family_reads_its_keys_as_its_transformers_config_class_does():
    from spill.models.config import parse_config

    qwen3 = parse_config(_raw("qwen3", head_dim=128, rope_theta=1e6, tie_word_embeddings=True))
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.rope_theta) == (128, True, 1e6)
    assert not (qwen3.qkv_bias or qwen3.o_bias or qwen3.windowed)
    assert parse_config(_raw("qwen3")).head_dim == 128  # Qwen3Config's default, not 1024 / 16
    assert parse_config(_raw("qwen3", attention_bias=True)).o_bias
    slid = parse_config(
        _raw("qwen3", use_sliding_window=True, sliding_window=64, max_window_layers=6)
    )
    assert (slid.sliding_window, slid.windowed) == (64, (6, 7))
    assert not parse_config(_raw("qwen3", sliding_window=64)).windowed  # use_sliding_window off

    assert parse_config(_raw("mistral", sliding_window=4096)).windowed == tuple(range(8))
    plain = parse_config(_raw("mistral", sliding_window=None))
    assert (plain.sliding_window, plain.windowed, plain.head_dim) == (None, (), 64)

    smol = parse_config(_raw("smollm3"))  # SmolLM3Config's defaults: theta 2e6, tied, every 4th
    assert (smol.rope_theta, smol.tie_word_embeddings, smol.no_rope) == (2e6, True, (3, 7))
    listed = parse_config(_raw("smollm3", no_rope_layers=[1, 0] * 4 + [1]))
    assert listed.no_rope == (1, 3, 5, 7)
    assert parse_config(_raw("smollm3", no_rope_layer_interval=2)).no_rope == (1, 3, 5, 7)
    windowed = parse_config(_raw("smollm3", use_sliding_window=True, sliding_window=32))
    assert windowed.windowed == (3, 7)  # SmolLM3Config: the NoPE layers slide


def test_rope_parameters_per_layer_type_are_read_when_equal_and_refused_when_not():
    from spill.errors import UnsupportedModel
    from spill.models.config import parse_config

    same = {"rope_type": "default", "rope_theta": 5e5}
    nested = {"full_attention": same, "sliding_attention": dict(same)}
    assert parse_config(_raw("qwen3", rope_parameters=nested)).rope_theta == 5e5
    assert parse_config(_raw("mistral", rope_parameters=same)).rope_theta == 5e5
    nested["sliding_attention"] = {"rope_type": "default", "rope_theta": 1e4}
    with pytest.raises(UnsupportedModel, match="differ by layer type") as err:
        parse_config(_raw("qwen3", rope_parameters=nested))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "keys, says",
    [
        ({"no_rope_layers": [1, 0, 1]}, "no_rope_layers lists 3 layers for 8"),
        (
            {"use_sliding_window": True, "sliding_window": 8, "layer_types": ["full_attention"]},
            "layer_types lists 1 layers for 8",
        ),
        ({"no_rope_layers": 5}, "a value of the wrong type"),
    ],
)
def test_a_per_layer_list_that_does_not_fit_the_layers_is_one_line(keys, says):
    from spill.errors import ModelError
    from spill.models.config import parse_config

    with pytest.raises(ModelError, match=says) as err:
        parse_config(_raw("smollm3", **keys), "m/config.json")
    assert "\n" not in str(err.value) and str(err.value).startswith("m/config.json: ")


def test_ministral_3_reads_its_yarn_and_query_scaling_as_transformers_derives_them():
    """transformers' own Ministral3Config (its default YaRN rope_parameters and
    llama_4_scaling_beta), as a text model and inside a mistral3 folder; the attention factor
    and inverse frequencies as its rotary embedding computes them."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from spill.engines.torch.ops import inv_freq
    from spill.models.config import parse_config

    text = transformers.Ministral3Config(num_hidden_layers=2, sliding_window=64)
    cfg = parse_config(text.to_dict())
    assert (cfg.family, cfg.rope_kind, cfg.query_beta, cfg.rope_original) == (
        "ministral3",
        "yarn",
        0.1,
        16384,
    )
    assert (cfg.head_dim, cfg.rope_theta, cfg.windowed) == (128, 1e6, (0, 1))
    rotary = transformers.models.ministral3.modeling_ministral3.Ministral3RotaryEmbedding(text)
    assert cfg.rope_attention == rotary.attention_scaling
    assert torch.equal(inv_freq(cfg), rotary.inv_freq)
    vision = transformers.Mistral3Config(text_config=text.to_dict()).to_dict()
    nested = parse_config(vision)
    assert (nested.family, nested.text_of, nested.query_beta) == ("ministral3", "mistral3", 0.1)
    plain = parse_config(transformers.Mistral3Config().to_dict())  # Mistral Small 3.1's text
    assert (plain.family, plain.text_of) == ("mistral", "mistral3")


@pytest.mark.parametrize(
    "keys, says",
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "llama_4_scaling_beta"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 4.0}}, "'linear'"),
    ],
)
def test_a_ministral_3_spill_cannot_run_is_refused_in_one_line(keys, says):
    from spill.errors import UnsupportedModel
    from spill.models.config import parse_config

    with pytest.raises(UnsupportedModel, match=says) as err:
        parse_config(_raw("ministral3", **keys), "m/config.json")
    assert "\n" not in str(err.value) and "ministral3" in str(err.value)
