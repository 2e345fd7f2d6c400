"""``tiny:<family>:<seed>[:<layers>x<hidden>]`` names a generated tiny model (issue 4)."""

from __future__ import annotations

import pytest

from spill.errors import ModelNotFound
from spill.models.cache import read_marker
from spill.models.names import TinyName, parse_tiny
from spill.models.resolve import resolve_model
from spill.models.weights import fingerprint


def test_parse_tiny():
    assert parse_tiny("tiny:llama:7") == TinyName("llama", 7, 4, 64)
    assert parse_tiny("TINY:qwen2:3:2x32").name == "tiny:qwen2:3:2x32"
    assert parse_tiny("smollm2:135m") is None
    with pytest.raises(ModelNotFound, match="tiny:<llama|qwen2>"):
        parse_tiny("tiny:gpt2:1")


def test_resolve_generates_once_and_is_deterministic(spill_home, tmp_path, monkeypatch):
    said = []
    a = resolve_model("tiny:llama:5:2x32", progress=said.append)
    assert a.source == "tiny" and a.model_id == "tiny:llama:5:2x32"
    assert a.folder == spill_home / "models" / "tiny" / "tiny-llama-5-2x32"
    assert len(said) == 1 and "first use" in said[0]
    again = resolve_model("tiny:llama:5:2x32", progress=said.append)
    assert again.folder == a.folder and len(said) == 1  # cached: nothing generated
    assert read_marker(a.folder)["name"] == "tiny:llama:5:2x32"
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "other-machine"))
    b = resolve_model("tiny:llama:5:2x32", progress=said.append)
    assert b.folder != a.folder and fingerprint(b.folder) == fingerprint(a.folder)
    assert not list((tmp_path / "other-machine" / "models" / "tiny").glob(".tiny-*"))
