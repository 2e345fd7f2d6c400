"""The GGUF writer's pieces against the importer they invert, and the export's plain checks."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from spill.errors import SpillError, UnsupportedModel, UsageError
from spill.jobs.export import check_options
from spill.jobs.export.gguf import _pre, gguf_name, permute
from spill.models.config import LINEARS
from spill.models.gguf import importer as gguf_import
from spill.models.gguf.arch import GLOBAL, LAYER
from spill.models.gguf.reader import LLAMA3_SPLIT


@pytest.mark.parametrize("heads, d", [(4, 64), (2, 32), (9, 576)])
def test_permute_is_undone_by_the_importers_unpermute(heads, d):
    w = np.random.default_rng(0).normal(size=(d, 24)).astype(np.float32)
    p = permute(w, heads)
    assert not np.array_equal(p, w)
    assert np.array_equal(gguf_import._unpermute(p, heads), w)


def test_every_hf_name_maps_to_the_gguf_name_the_importer_reads_back():
    hf = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    hf += [f"model.layers.3.{m}.weight" for m in LINEARS]
    hf += [
        "model.layers.3.input_layernorm.weight",
        "model.layers.3.post_attention_layernorm.weight",
    ]
    for name in hf:
        g = gguf_name(name)
        back = GLOBAL.get(g) or "model.layers.3." + LAYER[g.split(".", 2)[2]]
        assert back == name, (name, g)
    assert gguf_name("model.layers.0.self_attn.k_proj.bias") == "blk.0.attn_k.bias"


@pytest.mark.parametrize(
    "pre, name",
    [
        ({"type": "ByteLevel", "use_regex": True}, "gpt-2"),
        (
            {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits", "individual_digits": True},
                    {"type": "ByteLevel", "use_regex": True},
                ],
            },
            "smollm",
        ),
        (
            {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}},
                    {"type": "ByteLevel", "use_regex": False},
                ],
            },
            "llama-bpe",
        ),
    ],
)
def test_the_pre_tokenizer_gets_its_llama_cpp_name(pre, name):
    assert _pre({"pre_tokenizer": pre}, "tokenizer.json") == name


def test_an_unknown_pre_tokenizer_is_refused_in_one_line():
    with pytest.raises(UnsupportedModel, match="has no llama.cpp name spill knows"):
        _pre({"pre_tokenizer": {"type": "Metaspace"}}, "tokenizer.json")


@pytest.mark.parametrize(
    "args, words",
    [
        (("hf", None, "q8_0"), "does not apply to --format hf"),
        (("gguf", None, "4"), "does not apply to --format gguf"),
        (("mlx", None, "q4_0"), "does not apply to --format mlx"),
        (("onnx", None, None), "not one spill writes"),
        (("hf", "f64", None), "not one spill writes"),
    ],
)
def test_options_that_mean_nothing_are_usage_errors(args, words):
    with pytest.raises(UsageError, match=words):
        check_options(*args)


def test_a_folder_that_is_no_adapter_is_refused(tmp_path):
    from spill.jobs.export.merge import adapter_folder

    (tmp_path / "x.json").write_text(json.dumps({}))
    with pytest.raises(SpillError, match="no spill adapter here"):
        adapter_folder(tmp_path)
    with pytest.raises(SpillError, match="no such folder"):
        adapter_folder(tmp_path / "missing")


def _logprob(base: float, tuned: float, quantized: float) -> dict:
    tune, rounding = abs(tuned - base), abs(quantized - tuned)
    ratio = round(rounding / tune, 4) if tune else None
    return {"measure": "logprob", "train_file": "t.jsonl", "rows": 8, "tokens": 20,
            "base": base, "tuned": tuned, "quantized": quantized, "ratio": ratio}  # fmt: skip


@pytest.mark.parametrize(
    "numbers, said, warned",
    [
        ((-10.0, -9.0, -9.5), "moves them 0.50x as far as the tune did", True),
        ((-10.0, -9.0, -9.6), "moves them 0.60x as far", True),
        ((-10.0, -9.0, -9.4999), "moves them 0.50x as far", False),  # 0.4999: below the line
        ((-10.0, -9.0, -9.004), "moves them 0.004x as far", False),
        ((-10.0, -10.0, -10.5), "the tune did not move them", False),
    ],
)
def test_the_quantization_line_warns_at_half_the_tune_s_shift(numbers, said, warned):
    """Issue 35, item 29: the printed line names both shifts and their ratio, and adds the
    advice from a ratio of 0.5 on; an adapter that moved nothing has no ratio."""
    from spill.jobs.export.shift import line

    text = line("q4_0", _logprob(*numbers))
    assert text.startswith("q4_0 on 8 rows the tune saw (t.jsonl, 20 trained tokens)")
    assert said in text and ("export q8_0 or a float dtype" in text) == warned, text


def test_the_weight_space_line_says_why_it_is_in_weight_space():
    from spill.jobs.export.shift import line

    r = {"measure": "weights", "why": "the adapter is not in a tune's state", "matrices": 3,
         "tune_norm": 2.0, "quantization_norm": 1.5, "ratio": 0.75}  # fmt: skip
    text = line("q4_1", r)
    assert text.startswith("q4_1 moves the 3 adapted matrices by 0.75x the tune's own change")
    assert "weight space, since the adapter is not in a tune's state" in text
    assert text.endswith("export q8_0 or a float dtype")


def test_a_model_too_big_to_score_here_is_measured_in_weight_space(monkeypatch):
    """The log-prob measure writes a float32 copy and scores it: past SCORED_BYTES (about a
    billion parameters) seen_rows says why not, before it looks for any row."""
    from types import SimpleNamespace

    from spill.jobs.export import shift
    from spill.models.config import parse_config
    from spill.models.sources.tiny import _config

    cfg = parse_config(_config("llama", 2, 64, 256))
    inputs = SimpleNamespace(config=cfg, adapter_dir=Path("/nowhere/adapter"))
    assert "float32 copy" not in shift.seen_rows(inputs)  # small: it goes on to look for rows
    monkeypatch.setattr(shift, "SCORED_BYTES", 1000)
    why = shift.seen_rows(inputs)
    assert why.startswith("its float32 copy (") and why.endswith("too big to score here")
