"""What an export says about its base: PEFT's config names what PEFT can resolve (the hub
repository and commit the alias pins, not ``smollm2:135m``), and a README beside it names the
exact base weights (for a GGUF import: the file and its sha256)."""

from __future__ import annotations

import json

import numpy as np

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
