"""Gemma 3 text's config.json read as transformers 5's Gemma3TextConfig derives it (issue 37): the
sliding layers from ``layer_types`` or ``sliding_window_pattern``, the window's default, each
layer type's rotary base from ``rope_parameters`` or the older ``rope_theta`` /
``rope_local_base_freq``, the query scale; what spill does not compute (logit softcapping,
bidirectional attention, a scaled sliding rotary) refused in one line; a ``gemma3`` vision
folder's text model run by the CLI, which says so."""

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


def test_the_cli_runs_a_gemma3_vision_folders_text_model_and_says_so(tmp_path, tiny_models):
    """A ``gemma3`` folder (Gemma3ForConditionalGeneration): its text model runs, the pre-run
    line saying the vision tower is left aside (tests/unit/engines/test_gemma3_vision.py checks
    the numbers)."""
    from tests.unit.engines import hf_families

    folder = hf_families.make_vision(tmp_path / "gemma3", tiny_models["llama"])
    rows, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows.write_text(json.dumps({"id": 1, "prompt": "x"}) + "\n")
    proc = run_spill(
        "run",
        str(folder),
        str(rows),
        "--out",
        str(out),
        "--max-new-tokens",
        "3",
        env={"SPILL_HOME": str(tmp_path / "h")},
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "the text model of a gemma3 folder, its vision tower ignored (34 tensors)"
        in (proc.stderr.splitlines()[0])
    )
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [1]
