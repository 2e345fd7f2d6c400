"""spill's streamed LoRA tune of Qwen3, Mistral, SmolLM3 and Gemma 3 against transformers + PEFT
doing the same tune on the same transformers-made folders (``test_peft_parity``'s recipe: the same
initial adapter, micro-batches, accumulation, cosine schedule and AdamW, float32, rows of up to 14
tokens past the 6- and 7-token windows), and the exported PEFT adapter, loaded by PEFT, scoring as
spill does with the adapter."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from spill.engines.base import LoadOptions, ModelSpec
from spill.engines.torch import ENGINE
from spill.models.config import load_config
from spill.models.lora import export_peft, init_params
from tests.unit.engines import hf_families
from tests.unit.engines.test_peft_parity import (
    COMPLETIONS,
    LORA,
    PEFT_LOGPROB_TOLERANCE,
    PROMPTS,
    cosine,
    examples,
    hf_base,
    hf_log_probs,
    hf_tune,
    spill_tune,
)

peft = pytest.importorskip("peft")


@pytest.mark.parametrize(
    "variant",
    ["qwen3", "qwen3-windowed", "mistral", "smollm3", "gemma3", "phi3", "phi3-long", "ministral3"],
)
def test_streamed_tune_matches_peft(variant, tmp_path, tiny_models):
    """Phi-3's adapters sit on its fused linears, named as PEFT's target_modules name them."""
    folder = hf_families.make(variant, tmp_path / variant, tiny_models["llama"])
    cfg = load_config(folder)
    lora = replace(LORA, targets=LORA.parse_targets("all", cfg.linears))
    init, data = init_params(cfg, lora, 5), examples()
    ours, tuned = spill_tune(folder, init, data, lora)
    theirs, reference = hf_tune(folder, init, data, lora)
    rel = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs, strict=True))
    assert ours[-1] < ours[0]  # it learned something
    assert rel <= 1e-5
    assert min(cosine(tuned[n], reference[n]) for n in tuned) >= 0.9999

    adapter = export_peft(tuned, lora, str(folder), tmp_path / "adapter")
    loaded = peft.PeftModel.from_pretrained(hf_base(folder), str(adapter)).eval()
    runner = ENGINE.open(ModelSpec(folder, cfg), LoadOptions(ring=2, dtype="float32"))
    runner.use_adapter(lora, tuned)
    for prompt, completion, got in zip(
        PROMPTS, COMPLETIONS, runner.score(PROMPTS, COMPLETIONS), strict=True
    ):
        want = hf_log_probs(loaded, prompt, completion)
        assert np.abs(got - want).max() <= PEFT_LOGPROB_TOLERANCE
    runner.close()
