"""The text model of a ``gemma3`` (vision) folder, as transformers 5 saves
``Gemma3ForConditionalGeneration`` (``text_config``; ``language_model.model.*`` and, untied,
``language_model.lm_head.weight``), and as transformers 4.52-4.57 named its tensors
(``model.language_model.*``, ``lm_head.weight``): spill reads ``text_config`` and the text
weights by their own names, leaves the vision tower aside and says so on the pre-run line; its
log-probs are transformers' on text-only input within 1e-5 and its greedy tokens ``generate``'s
(float32, rows past the window), on both engines, and equal bit for bit those of the same text
model saved as a ``gemma3_text`` folder."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from spill.engines.base import GenerateParams
from spill.errors import ModelError
from spill.models.config import load_config, parse_config
from spill.models.weights import weight_files
from tests.unit.engines import hf_families
from tests.unit.engines.kit import PROMPTS, open_runner, same
from tests.unit.engines.test_families import ROWS, hf_log_probs

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
NEW = 12


def _text_folder(vision, folder, tokenizer_from):
    """The vision folder's text model alone, saved by transformers as a ``gemma3_text`` folder."""
    whole = transformers.Gemma3ForConditionalGeneration.from_pretrained(vision, dtype=torch.float32)
    text = transformers.Gemma3ForCausalLM(whole.config.text_config).float().eval()
    text.model.load_state_dict(whole.model.language_model.state_dict())
    text.lm_head.load_state_dict(whole.lm_head.state_dict())
    text.save_pretrained(folder)
    for f in hf_families.TOKENIZER:
        (folder / f).write_bytes((tokenizer_from / f).read_bytes())
    return folder


def _older_layout(vision, folder):
    """The same folder as transformers 4.52-4.57 named its tensors."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    for path in vision.iterdir():
        if path.suffix != ".safetensors":
            (folder / path.name).write_bytes(path.read_bytes())
    names = {
        "language_model.model.": "model.language_model.",
        "language_model.lm_head.": "lm_head.",
    }
    renamed = {}
    for name, t in load_file(vision / "model.safetensors").items():
        old = next((p for p in names if name.startswith(p)), None)
        renamed[names[old] + name[len(old) :] if old else f"model.{name}"] = t
    save_file(renamed, folder / "model.safetensors", {"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_models):
    root, tok = tmp_path_factory.mktemp("gemma3-vision"), tiny_models["llama"]
    out = {}
    for tied in (True, False):
        key = "tied" if tied else "untied"
        out[key] = hf_families.make_vision(root / key, tok, tied=tied, seed=3)
        out[f"{key}-text"] = _text_folder(out[key], root / f"{key}-text", tok)
        out[f"{key}-older"] = _older_layout(out[key], root / f"{key}-older")
    return out


@pytest.fixture(params=["tied", "untied"])
def tied(request):
    return request.param


def test_the_config_and_weights_are_the_text_models(folders, tied):
    cfg, text = load_config(folders[tied]), load_config(folders[f"{tied}-text"])
    assert cfg.text_of == "gemma3" and text.text_of is None
    assert cfg.family == "gemma3_text" and cfg.windowed == (0, 2)
    assert replace(cfg, text_of=None) == text
    files, own = weight_files(folders[tied]), weight_files(folders[f"{tied}-text"])
    assert files.tensor_shard.keys() == own.tensor_shard.keys()
    assert ("lm_head.weight" in files.tensor_shard) == (tied == "untied")
    assert files.ignored > 0 and own.ignored == 0
    assert weight_files(folders[f"{tied}-older"]).tensor_shard.keys() == own.tensor_shard.keys()


def test_a_gemma3_config_without_text_config_is_refused_in_one_line():
    with pytest.raises(ModelError, match="without a text_config object; the model folder's"):
        parse_config({"model_type": "gemma3", "vision_config": {}})


def test_scores_and_greedy_match_transformers(engine, folders, tied):
    folder = folders[tied]
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    hf = hf.eval()
    runner = open_runner(engine, folder, ring=2, dtype="float32")
    assert "its vision tower ignored (" in runner.info.line()
    for prompt, completion, ours in zip(*ROWS, runner.score(*ROWS), strict=True):
        assert np.abs(ours - hf_log_probs(hf, prompt, completion)).max() <= 1e-5
    for prompt in (PROMPTS[0], ROWS[0][-1]):
        ours = runner.generate([prompt], GenerateParams(max_new_tokens=NEW), [0])[0]
        out = hf.generate(torch.tensor(prompt)[None], do_sample=False, max_new_tokens=NEW)
        assert ours.tokens.tolist() == out[0, len(prompt) :].tolist()[: len(ours.tokens)]
    runner.close()


def test_every_layout_scores_as_the_text_folder_bit_for_bit(engine, folders, tied):
    got = {}
    for key in (tied, f"{tied}-text", f"{tied}-older"):
        runner = open_runner(engine, folders[key], resident=True, dtype="float32")
        got[key] = runner.score(*ROWS)
        runner.close()
    assert same(got[tied], got[f"{tied}-text"]) and same(got[tied], got[f"{tied}-older"])
    assert json.loads((folders[tied] / "config.json").read_text())["model_type"] == "gemma3"
