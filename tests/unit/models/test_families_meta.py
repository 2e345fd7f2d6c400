"""The families' metadata outside the engines (issue 37): every family has a tiny random model
(``spill models tiny --family``, ``tiny:<family>:<seed>``) whose config.json carries what the
family adds (Qwen3's explicit head_dim and q/k norms, Mistral's sliding window, SmolLM3's NoPE
layers), and a GGUF of a family whose llama.cpp names spill does not read is refused in one
line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from spill.models.config import FAMILIES, load_config
from spill.models.names import parse_tiny
from spill.models.tiny import TINY_FAMILIES, write_tiny
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


@pytest.mark.parametrize("family", ["qwen3", "mistral", "smollm3"])
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


@pytest.mark.parametrize("arch", ["qwen3", "smollm3", "mistral3"])
def test_a_gguf_of_a_family_spill_imports_no_gguf_of_is_refused_in_one_line(arch, tmp_path):
    """spill runs these families from HF folders; their llama.cpp tensor names are not read yet,
    so a GGUF of one is refused before anything is written (llama.cpp names each by its arch)."""
    from spill.errors import UnsupportedModel
    from spill.models.gguf_import import import_gguf
    from tests.unit.models.gguf_bytes import small_llama, small_metadata

    meta = small_metadata()
    meta = {k.replace("llama.", f"{arch}.", 1): v for k, v in meta.items()}
    path = small_llama(tmp_path / "m.gguf", meta | {"general.architecture": arch})
    with pytest.raises(UnsupportedModel) as err:
        import_gguf(path, tmp_path / "out")
    assert "\n" not in str(err.value) and f"GGUF architecture {arch!r} is not supported" in str(
        err.value
    )
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
