"""``provenance.home`` and ``genuine`` for quantized names: which cache folder a bundled
quantized model may take, and the copy this machine's source makes for it (issue 22)."""

from __future__ import annotations

import json

import pytest

from spill.ground.paths import models_dir
from spill.models import provenance
from spill.models.resolve import quantize_model
from spill.models.sources.quantize import quantized_folder

GGUF = {"kind": "gguf", "model_id": "HuggingFaceTB/SmolLM2-135M-Instruct"}


def test_home_of_quantized_names(spill_home):
    models = models_dir()
    assert provenance.home("smollm2:135m", GGUF) == models / "smollm2-135m-q4_1"
    assert provenance.home("smollm2:135m@q4_1", GGUF) == models / "smollm2-135m-q4_1"
    assert provenance.home("smollm2:135m@f32", GGUF) == models / "smollm2-135m"
    copy = {"kind": "imported", "model_id": "tiny:llama:1:4x64"}
    assert provenance.home("tiny:llama:1@q4g32", copy) == quantized_folder(
        "tiny:llama:1:4x64", 4, 32
    )
    assert provenance.home("tiny:llama:1@q4g32", {"kind": "gguf"}) is None  # not what it claims
    assert provenance.home("org/model@q4g64", {"kind": "imported"}) is None  # no source here
    assert provenance.home("qwen2.5:0.5b@q4_1", GGUF) is None  # no offline GGUF serves it


def test_genuine_quantized_tiny_is_the_bytes_quantize_writes(spill_home, tmp_path):
    made = quantize_model("tiny:llama:1", 4, 32, progress=lambda _: None)
    again = provenance.genuine(
        "tiny:llama:1@q4g32", {"kind": "imported"}, 60_000, tmp_path / "g", lambda _: None
    )
    files = {p.name for p in made.iterdir()}
    assert {p.name for p in again.iterdir()} == files
    for name in files - {"spill-source.json"}:
        assert (again / name).read_bytes() == (made / name).read_bytes(), name
    ours, theirs = (json.loads((f / "spill-source.json").read_text()) for f in (again, made))
    assert {n: r["sha256"] for n, r in ours["files"].items()} == {
        n: r["sha256"] for n, r in theirs["files"].items()
    }
    assert (ours["name"], ours["source"], ours["uri"]) == (
        theirs["name"],
        theirs["source"],
        theirs["uri"],
    )
    assert not (tmp_path / "g-float").exists()  # the float copy it quantized is gone


def test_genuine_refuses_a_tiny_copy_far_larger_than_offered(spill_home, tmp_path):
    with pytest.raises(provenance.Unverifiable, match="far more than"):
        provenance.genuine(
            "tiny:llama:1:64x2048@q4g64", {"kind": "imported"}, 1000, tmp_path / "g", print
        )
    assert not (tmp_path / "g").exists()
