"""The GGUF writer refuses, in one line and before writing anything, what it has no GGUF form
for: a family other than llama and qwen2, and a Qwen2 whose layers slide (``use_sliding_window``),
which llama.cpp's qwen2 would run attending to every key (issue 37)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from spill.errors import UnsupportedModel
from spill.jobs.export.gguf import _refuse_unwritable
from spill.models.config import parse_config
from spill.models.tiny import write_tiny


def _refusal(cfg) -> str:
    with pytest.raises(UnsupportedModel) as err:
        _refuse_unwritable(SimpleNamespace(config=cfg, base_name="base"))
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "smollm3"])
def test_a_family_without_a_gguf_form_is_refused(family, tmp_path):
    raw = json.loads((write_tiny(tmp_path / family, family) / "config.json").read_text())
    said = _refusal(parse_config(raw))
    assert f"no GGUF of a {family} model yet (only llama and qwen2)" in said


def test_a_qwen2_with_sliding_layers_is_refused_and_one_without_is_not(tmp_path):
    raw = json.loads((write_tiny(tmp_path / "q", "qwen2") / "config.json").read_text())
    _refuse_unwritable(SimpleNamespace(config=parse_config(raw), base_name="base"))
    raw |= {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}
    cfg = parse_config(raw)
    assert cfg.windowed == (2, 3)
    assert "sliding-window layers have no GGUF form" in _refusal(cfg)
