"""Gemma 3 text's config.json read as transformers 5's Gemma3TextConfig derives it (issue 37): the
sliding layers from ``layer_types`` or ``sliding_window_pattern``, the window's default, each
layer type's rotary base from ``rope_parameters`` or the older ``rope_theta`` /
``rope_local_base_freq``, the query scale; what spill does not compute (logit softcapping,
bidirectional attention, a scaled sliding rotary, a ``gemma3`` vision folder) refused in one
line, by the CLI too, before anything is written."""

from __future__ import annotations

import json

import pytest

from spill.errors import UnsupportedModel
from spill.models.config import parse_config
from tests.conftest import run_spill

transformers = pytest.importorskip("transformers")

SHAPE = {
    "model_type": "gemma3_text",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 112,
    "num_hidden_layers": 7,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def _transformers(raw: dict):
    keys = {k: v for k, v in raw.items() if k != "model_type"}
    return transformers.Gemma3TextConfig(**keys)


@pytest.mark.parametrize(
    "keys",
    [
        {},  # every default: window 4096, pattern 6, bases 1e6 and 1e4, head_dim 256, scalar 256
        {"sliding_window_pattern": 3, "sliding_window": 9, "query_pre_attn_scalar": 20},
        {"rope_theta": 5e5, "rope_local_base_freq": 2e4, "head_dim": 24},
        {
            "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 5,
            "rope_parameters": {
                "full_attention": {"rope_type": "default", "rope_theta": 3e5},
                "sliding_attention": {"rope_type": "default", "rope_theta": 7e3},
            },
        },
    ],
)
def test_each_key_reads_as_gemma3_text_config_derives_it(keys):
    raw = SHAPE | keys
    ours, theirs = parse_config(raw), _transformers(raw)
    sliding = [i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention"]
    assert ours.windowed == tuple(sliding) and ours.sliding_window == theirs.sliding_window
    assert ours.rope_theta == theirs.rope_parameters["full_attention"]["rope_theta"]
    assert ours.local_rope_theta == theirs.rope_parameters["sliding_attention"]["rope_theta"]
    assert ours.query_scale == theirs.query_pre_attn_scalar**-0.5
    assert ours.head_dim == theirs.head_dim and ours.tie_word_embeddings
    assert ours.embed_scale == 64**0.5 and ours.norm_offset == 1.0
    keys = ours.layer_keys()
    assert "pre_feedforward_layernorm.weight" in keys and "self_attn.k_norm.weight" in keys


@pytest.mark.parametrize(
    "keys, says",
    [
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "bidirectional"),
        ({"hidden_activation": "silu"}, "hidden_activation"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "factor": 2.0},
                }
            },
            "sliding layers",
        ),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "'dynamic'"),
    ],
)
def test_what_spill_does_not_compute_is_refused_in_one_line(keys, says):
    with pytest.raises(UnsupportedModel) as e:
        parse_config(SHAPE | keys)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_a_gemma3_vision_folder_is_refused_by_the_cli_in_one_line(tmp_path):
    folder = tmp_path / "gemma3"
    folder.mkdir()
    text = {k: v for k, v in SHAPE.items() if k != "model_type"}
    config = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}
    (folder / "config.json").write_text(json.dumps(config | {"text_config": text}))
    rows, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows.write_text(json.dumps({"id": 1, "prompt": "x"}) + "\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = run_spill(
        "run", str(folder), str(rows), "--out", str(out), env={"SPILL_HOME": str(tmp_path / "h")}
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and "Traceback" not in proc.stderr
    assert lines[0].startswith("spill: error: ") and "model_type 'gemma3'" in lines[0]
    assert "gemma3_text" in lines[0]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name != "h") == [
        n for n in before if n != "h"
    ]
