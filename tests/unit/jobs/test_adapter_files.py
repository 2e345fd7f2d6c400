"""What an export says about its base: PEFT's config names what PEFT can resolve (the hub
repository and commit the alias pins, not ``smollm2:135m``), and a README beside it names the
exact base weights (for a GGUF import: the file and its sha256)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from spill.jobs.adapter_files import write_local
from spill.models.cache import write_marker
from spill.models.lora import LoraConfig
from spill.models.names import lookup

FILES = {"config.json": "a" * 64, "model.safetensors": "b" * 64}
LORA = LoraConfig(rank=4, alpha=8.0, dropout=0.0, targets=("q_proj", "v_proj"))


def test_an_alias_exports_its_hub_id_and_the_gguf_it_was_imported_from(tmp_path, spill_home):
    from huggingface_hub.utils import validate_repo_id
    from peft import PeftConfig

    folder = (
        spill_home / "models" / "smollm2-135m-q4_1"
    )  # where the kept import of the bare name lives
    folder.mkdir(parents=True)
    files = {n: {"size": 1, "sha256": s, "from": "local"} for n, s in FILES.items()}
    write_marker(folder, source="gguf", file="SmolLM2-135M-Instruct.Q4_1.gguf", sha256="c" * 64)
    write_marker(folder, files=files)
    params = {
        "layers.0.self_attn.q_proj.lora_a": np.zeros((8, 4), np.float32),
        "layers.0.self_attn.q_proj.lora_b": np.zeros((4, 8), np.float32),
    }
    out = write_local(tmp_path / "a", params, LORA, "smollm2:135m", "sha256:f", 1, [1.0], FILES)
    alias = lookup("smollm2:135m")
    cfg = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == alias.model_id == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert cfg["revision"] == alias.revision
    validate_repo_id(cfg["base_model_name_or_path"])  # what AutoPeftModelForCausalLM checks first
    assert PeftConfig.from_pretrained(str(out / "peft")).base_model_name_or_path == alias.model_id
    text = (out / "README.md").read_text()
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in text and "c" * 64 in text
    assert f"`{alias.model_id}` at commit `{alias.revision}`" in text
    assert all(f"`{n}`: sha256 `{s}`" in text for n, s in FILES.items())
    # other weights than the import's: no GGUF is claimed
    other = write_local(tmp_path / "b", params, LORA, "smollm2:135m", "sha256:f", 1, [1.0], {})
    assert "GGUF" not in (other / "README.md").read_text()


def test_a_tiny_model_keeps_its_name(tmp_path):
    params = {"layers.0.self_attn.q_proj.lora_a": np.zeros((8, 4), np.float32)}
    params["layers.0.self_attn.q_proj.lora_b"] = np.zeros((4, 8), np.float32)
    out = write_local(tmp_path / "a", params, LORA, "tiny:llama:2:2x64", "sha256:f", 1, [1.0])
    cfg = json.loads((out / "peft" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "tiny:llama:2:2x64" and "revision" not in cfg
    assert "hub repository" not in (out / "README.md").read_text()


def test_expert_adapters_publish_mlx_and_say_why_peft_cannot_hold_them(tmp_path):
    """A Qwen3-MoE adapter on every expert and on a dense layer's MLP: mlx/ holds the experts
    stacked (``LoRASwitchLinear``) and the dense MLP by name; PEFT 0.21 has no form for the
    dense MLP beside experts, so peft/ holds one line saying so instead of a wrong adapter."""
    from spill.models.config import parse_config
    from spill.models.lora import init_params

    raw = {
        "model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
        "mlp_only_layers": [1],
    }  # fmt: skip
    cfg = parse_config(raw)
    lora = LoraConfig(rank=2, targets=("q_proj", "gate_proj", "up_proj", "down_proj"))
    params = init_params(cfg, lora, 0)
    out = write_local(tmp_path / "a", params, lora, "tiny:qwen3_moe", "sha256:f", 2, [1.0])
    note = (out / "peft" / "README.md").read_text()
    assert note.count("\n") == 1 and "dense layer's MLP adapter has no PEFT form" in note
    assert sorted(p.name for p in (out / "peft").iterdir()) == ["README.md"]
    assert "- `peft/`: not written: PEFT 0.21 maps" in (out / "README.md").read_text()
    stacked = load_file(out / "mlx" / "adapters.safetensors")
    assert stacked["model.layers.0.mlp.switch_mlp.down_proj.lora_a"].shape == (4, 2, 8)
    assert stacked["model.layers.0.mlp.switch_mlp.gate_proj.lora_b"].shape == (4, 8, 2)
    assert "model.layers.1.mlp.down_proj.lora_a" in stacked
    keys = json.loads((out / "mlx" / "adapter_config.json").read_text())["lora_parameters"]
    assert keys["keys"] == [
        "self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        "mlp.switch_mlp.gate_proj", "mlp.switch_mlp.up_proj", "mlp.switch_mlp.down_proj",
    ]  # fmt: skip


def test_a_peft_gate_up_adapter_mixing_gate_and_up_is_refused_on_read(tmp_path):
    """spill holds an expert's gate and up apart: a PEFT gate_up_proj adapter whose B is not
    block-diagonal (one PEFT trained) has no spill form, refused in one line."""
    from spill.errors import SpillError
    from spill.jobs.adapter_files import load_adapter
    from spill.models.lora import export_peft

    rng = np.random.default_rng(0)
    params = {
        f"layers.0.mlp.experts.{e}.{p}.lora_{ab}": rng.normal(size=s).astype(np.float32)
        for e in range(3)
        for p in ("gate_proj", "up_proj")
        for ab, s in (("a", (16, 2)), ("b", (2, 8)))
    }
    lora = LoraConfig(rank=2, targets=("gate_proj", "up_proj"))
    folder = export_peft(params, lora, "m", tmp_path / "peft")
    back = load_adapter(folder)
    assert back.lora == lora and all(np.array_equal(back.params[n], params[n]) for n in params)
    tensors = load_file(folder / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.mlp.experts.lora_B.weight"
    assert tensors[key].shape == (16, 4 * 3)  # (2 x 8 out, 2r x 3 experts)
    tensors[key] = np.ascontiguousarray(tensors[key] + 1.0)
    save_file(tensors, folder / "adapter_model.safetensors")
    with pytest.raises(SpillError, match="mixes gate and up in one rank") as e:
        load_adapter(folder)
    assert "\n" not in str(e.value)
