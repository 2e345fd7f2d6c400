"""The text model of a ``mistral3`` (vision) folder around a Ministral 3 text model, as
transformers 5 saves ``Mistral3ForConditionalGeneration`` (``text_config`` of model_type
``ministral3``; ``model.language_model.*`` and ``lm_head.weight``): spill runs its text model,
the Pixtral tower left aside, with log-probs within 1e-5 of transformers' ``Ministral3ForCausalLM``
holding the same weights, and greedy tokens equal to its ``generate`` (float32, rows past YaRN's
original length), on both engines."""

from __future__ import annotations

import numpy as np
import pytest

from spill.engines.base import GenerateParams
from spill.models.config import load_config
from tests.unit.engines import hf_families
from tests.unit.engines.kit import PROMPTS, open_runner
from tests.unit.engines.test_families import LONG, ROWS, hf_log_probs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
PIXTRAL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=1,
    num_attention_heads=2,
    head_dim=16,
    image_size=28,
    patch_size=14,
)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_models):
    """(the mistral3 folder, transformers' Ministral3ForCausalLM of its text weights)."""
    root = tmp_path_factory.mktemp("mistral3")
    text = {**hf_families.SHAPE, **hf_families.VARIANTS["ministral3"][1]}
    config = transformers.Mistral3Config(
        text_config={"model_type": "ministral3", **text},
        vision_config={"model_type": "pixtral", **PIXTRAL},
    )
    torch.manual_seed(0)
    whole = transformers.Mistral3ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for key, p in whole.named_parameters():
            if "norm" in key:
                p.add_(torch.randn_like(p) * 0.2)
    whole.save_pretrained(root / "vision")
    for f in hf_families.TOKENIZER:
        (root / "vision" / f).write_bytes((tiny_models["llama"] / f).read_bytes())
    alone = transformers.Ministral3ForCausalLM(whole.config.text_config).float().eval()
    alone.model.load_state_dict(whole.model.language_model.state_dict())
    alone.lm_head.load_state_dict(whole.lm_head.state_dict())
    alone.generation_config.eos_token_id = [hf_families.SHAPE["eos_token_id"]]
    return root / "vision", alone


def test_the_config_is_the_text_model_of_a_mistral3_folder(folders):
    cfg = load_config(folders[0])
    assert (cfg.family, cfg.text_of, cfg.query_beta, cfg.rope_kind) == (
        "ministral3",
        "mistral3",
        0.3,
        "yarn",
    )


def test_log_probs_and_greedy_match_transformers_text_model(engine, folders):
    folder, hf = folders
    runner = open_runner(engine, folder, ring=2, dtype="float32")
    for prompt, completion, ours in zip(*ROWS, runner.score(*ROWS), strict=True):
        assert np.abs(ours - hf_log_probs(hf, prompt, completion)).max() <= 1e-5
    stop = tuple(hf.generation_config.eos_token_id)
    for prompt in (PROMPTS[0], LONG[0]):
        ours = runner.generate([prompt], GenerateParams(max_new_tokens=12, stop_ids=stop), [0])[0]
        out = hf.generate(torch.tensor(prompt)[None], do_sample=False, max_new_tokens=12)
        theirs = out[0, len(prompt) :].tolist()
        assert ours.tokens.tolist() == theirs[: len(ours.tokens)]
    runner.close()
