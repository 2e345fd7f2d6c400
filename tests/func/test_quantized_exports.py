"""A LoRA adapter tuned on a quantized base, in the ecosystem's readers.

The run is the drills' quantized control (the tiny llama's 4-bit g32 copy, streamed through a
ring of 2, float32). Its PEFT layout is loaded by ``peft.PeftModel.from_pretrained`` on the
float32 folder of the quantized values (``dequantize_folder``) and must score as spill does on
the packed folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spill.jobs.adapter_files import load_adapter
from spill.models.sources.quantize import dequantize_folder
from tests.func import tune_kit as kit

# float32, spill's streamed scoring on the packed folder vs PEFT on its float values: measured
# 6.7e-6 in a torch-only process (the 1e-5); the float parity test measured up to
# 1.05e-5 once MLX's tests had preloaded OpenBLAS into the same process, hence 2e-5.
PEFT_LOGPROB_TOLERANCE = 2e-5
PROMPTS = [np.array([5, 6, 7, 8, 9, 10]), np.array([100, 3]), np.arange(20, 40)]
COMPLETIONS = [np.array([11, 12, 13]), np.array([4, 5, 6, 7]), np.array([1])]


@pytest.fixture(scope="module")
def control(tmp_path_factory, tiny_models) -> kit.Control:
    return kit.control(tmp_path_factory, tiny_models, variant="quantized")


def _hf_log_probs(model, prompt, completion) -> np.ndarray:
    import torch

    ids = torch.tensor(np.concatenate([prompt, completion])[None])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    at = torch.arange(len(prompt) - 1, len(prompt) + len(completion) - 1)
    return logp[at, torch.tensor(completion)].numpy()


def test_the_adapter_names_its_quantized_base(control):
    meta = json.loads((Path(control.state) / "adapter" / "adapter.json").read_text())
    assert meta["quantization"] == {
        "bits": 4, "group_size": 32, "source": "affine", "format": "4-bit affine g32",
    }  # fmt: skip
    note = (Path(control.state) / "adapter" / "README.md").read_text()
    assert "- quantized: 4-bit affine g32 (affine)" in note
    load_adapter(Path(control.state) / "adapter")  # its schema takes it


def test_the_peft_layout_on_the_dequantized_folder_scores_as_spill(control, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from spill.engines.base import LoadOptions, ModelSpec
    from spill.engines.torch import ENGINE
    from spill.models.config import load_config

    plain = dequantize_folder(control.model, tmp_path / "plain")
    assert "quantization" not in json.loads((plain / "config.json").read_text())
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    tuned = peft.PeftModel.from_pretrained(hf, f"{control.state}/adapter/peft").eval()
    adapter = load_adapter(Path(control.state) / "adapter")
    runner = ENGINE.open(
        ModelSpec(control.model, load_config(control.model)), LoadOptions(ring=2, dtype="float32")
    )
    try:
        runner.use_adapter(adapter.lora, adapter.params)
        ours = runner.score(PROMPTS, COMPLETIONS)
    finally:
        runner.close()
    worst = 0.0
    for prompt, completion, got in zip(PROMPTS, COMPLETIONS, ours, strict=True):
        want = _hf_log_probs(tuned, prompt, completion)
        worst = max(worst, float(np.abs(got - want).max()))
    print(
        f"worst log-prob difference, spill on the packed folder vs PEFT on its values: {worst:.1e}"
    )
    assert worst <= PEFT_LOGPROB_TOLERANCE
