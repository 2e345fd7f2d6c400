"""``quantized_copy`` (what ``--quantize`` and ``model.quantize`` ask for): a float model's copy
made on first use with the bytes ``spill models quantize`` writes, one line saying so, found
again without a line; an already quantized model only as what it is. ``identity``: what a run's
identity records of each kind of base. And a tune's refusal: quantization first, an old float
identity (no key) continuing as before."""

from __future__ import annotations

import pytest

from spill.errors import ModelError
from spill.ground.hashing import file_sha256
from spill.jobs.tune.identity import CheckpointMismatch, _refuse_model
from spill.models.quant import Spec
from spill.models.resolve import quantize_model, quantized_copy, resolve_model
from spill.models.sources.quantize import identity, quantized_folder


def _said():
    lines: list[str] = []
    return lines, lines.append


def test_the_copy_is_made_once_with_the_bytes_of_spill_models_quantize(tmp_path, monkeypatch):
    lines, say = _said()
    model = resolve_model("tiny:llama:4", progress=lambda _: None)
    got = quantized_copy(model, Spec(8, 32), say)
    folder = quantized_folder("tiny:llama:4:4x64", 8, 32)
    assert (got.name, got.folder, got.source) == ("tiny:llama:4:4x64@q8g32", folder, "quantized")
    assert got.model_id == model.model_id and got.revision is None
    assert lines == [
        f"making tiny:llama:4:4x64@q8g32, the 8-bit g32 copy of tiny:llama:4:4x64, in {folder} "
        "(first use only)"
    ]
    assert quantized_copy(model, Spec(8, 32), say).folder == folder and len(lines) == 1
    made = {p.name: file_sha256(p) for p in folder.iterdir() if p.suffix == ".safetensors"}
    other = tmp_path / "home"
    monkeypatch.setenv("SPILL_HOME", str(other))  # a second cache: the command writes its own
    again = quantize_model("tiny:llama:4", 8, 32, progress=lambda _: None)
    assert again != folder
    assert {p.name: file_sha256(p) for p in again.iterdir() if p.suffix == ".safetensors"} == made
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".quantizing")]


def test_an_already_quantized_model_is_only_what_it_is():
    model = resolve_model("tiny:qwen2:5", progress=lambda _: None)
    q4 = quantized_copy(model, Spec(4, 64), lambda _: None)
    assert quantized_copy(q4, Spec(4, 64), lambda _: None) == q4  # what it is: as it is
    with pytest.raises(ModelError) as e:
        quantized_copy(q4, Spec(8, 64), lambda _: None)
    assert str(e.value) == (
        "tiny:qwen2:5:4x64@q4g64 is already quantized (4-bit affine g64), so it cannot be made "
        "8-bit g64: ask for what it is (--quantize 4 --group-size 64), or quantize its float model"
    )


def test_identity_names_bits_group_source_and_format():
    model = resolve_model("tiny:llama:4", progress=lambda _: None)
    assert identity(model.folder) is None  # float: no key, as before quantized bases
    q = quantized_copy(model, Spec(4, 32), lambda _: None)
    assert identity(q.folder) == {
        "bits": 4,
        "group_size": 32,
        "source": "spill affine",
        "format": "4-bit affine g32",
    }


def _model(fp: str, quantization: dict | None = None, name: str = "m") -> dict:
    return {"id": name, "fingerprint": fp} | (
        {"quantization": quantization} if quantization else {}
    )


Q4 = {"bits": 4, "group_size": 64, "source": "spill affine", "format": "4-bit affine g64"}
Q8 = {"bits": 8, "group_size": 64, "source": "spill affine", "format": "8-bit affine g64"}


def test_a_tune_names_the_quantization_before_the_fingerprint(tmp_path):
    _refuse_model(_model("a"), _model("a"), "ckpt", tmp_path)  # an old float identity: continues
    _refuse_model(_model("a"), _model("a", None, "other name"), "ckpt", tmp_path)
    _refuse_model(
        _model("q", None, "m@q4_1"), _model("q", Q4, "m@q4_1"), "ckpt", tmp_path
    )  # same weights
    with pytest.raises(CheckpointMismatch) as e:
        _refuse_model(_model("q4", Q4, "m@q4g64"), _model("q8", Q8, "m@q8g64"), "ckpt", tmp_path)
    assert str(e.value) == (
        "ckpt was made on m@q4g64 (4-bit affine g64), this run has m@q8g64 (8-bit affine g64); "
        "continue it on that base (--quantize 4 --group-size 64), or start fresh with another "
        "--state (or --name)"
    )
    with pytest.raises(CheckpointMismatch, match=r"without --quantize\), or start fresh"):
        _refuse_model(_model("f"), _model("q4", Q4, "m@q4g64"), "ckpt", tmp_path)
    with pytest.raises(CheckpointMismatch, match="weights \\(fingerprint\\) 'a'"):
        _refuse_model(
            _model("a", Q4, "x"), _model("b", Q4, "y"), "ckpt", tmp_path
        )  # same format, other


def test_another_folder_of_the_same_name_gets_a_copy_of_its_own(tmp_path):
    """A bundle's own weights (or a staged copy) under a name whose cached copy came from the
    name's own folder: never the other folder's values."""
    from dataclasses import replace

    from spill.models.sources.tiny import write_tiny

    model = resolve_model("tiny:llama:4", progress=lambda _: None)
    own = quantized_copy(model, Spec(4, 64), lambda _: None)
    other = replace(model, folder=write_tiny(tmp_path / "bundled", "llama", seed=9))
    lines, say = _said()
    theirs = quantized_copy(other, Spec(4, 64), say)
    assert theirs.name == own.name and theirs.folder != own.folder and len(lines) == 1
    assert quantized_copy(other, Spec(4, 64), say).folder == theirs.folder and len(lines) == 1
    assert quantized_copy(model, Spec(4, 64), say).folder == own.folder
    shards = [f.folder / "model.safetensors" for f in (own, theirs)]
    assert file_sha256(shards[0]) != file_sha256(shards[1])
