"""The JSON Schemas load from the package, are valid draft 2020-12, and refuse in one line;
``validate_once`` remembers only what passed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from spill.ground import validate as validation
from spill.ground.validate import (
    SchemaInvalid,
    load_schema,
    parse_json,
    remember,
    validate,
    validate_once,
)
from tests.unit.payloads.payload_worker import IDENTITY, tensors

NAMES = ["checkpoint-state", "commit", "segment-commit", "row-identity", "machine"]


@pytest.fixture
def data():
    """``data(step) -> (params, opt, state)``, the checkpoint content the payload tests save."""
    return tensors


@pytest.fixture
def identity() -> dict:
    return IDENTITY


@pytest.mark.parametrize("name", NAMES)
def test_schema_is_valid_2020_12(name):
    schema = load_schema(f"{name}.schema.json")
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)


def test_state_example_validates_and_a_bad_one_names_the_field(data):
    _, _, state = data(3)
    validate({"schema_version": 1, **state}, "checkpoint-state")
    bad = {"schema_version": 1, **state, "producers": [{"from_step": 1, "engine": "torch"}]}
    with pytest.raises(SchemaInvalid) as e:
        validate(bad, "checkpoint-state", where="x/state.json")
    assert "x/state.json" in str(e.value) and "producers/0" in str(e.value)
    assert "\n" not in str(e.value)


def test_identity_needs_model_and_input(identity):
    validate({"schema_version": 1, **identity}, "row-identity")
    with pytest.raises(SchemaInvalid, match="input"):
        validate({"schema_version": 1, "model": identity["model"]}, "row-identity")


def test_a_huge_value_is_refused_in_one_short_line():
    doc = {"schema_version": 1, "model": {"id": "m\n" * 100_000, "fingerprint": 7}}
    with pytest.raises(SchemaInvalid) as e:
        validate(doc, "row-identity", where="x/identity.json")
    text = str(e.value)
    assert "\n" not in text and len(text) < 400, text


def test_parse_json_turns_every_failure_into_value_error():
    assert parse_json(b'{"a": [1]}') == {"a": [1]}
    bad = [b"[" * 100_000 + b"]" * 100_000, b'{"a": "\xff"}', b"{", b"1" * 5000]
    bad += [b'{"a": "\xed\xa0\x80"}', b'{"a": "\\ud800"}']  # surrogates: no characters
    assert parse_json(b'{"a": "\\ud83d\\ude00"}') == {"a": "\U0001f600"}  # a pair is one
    for raw in bad:
        with pytest.raises(ValueError):
            parse_json(raw)


def _markers(home) -> list:
    folder = home / "validated"
    return sorted(folder.iterdir()) if folder.is_dir() else []


def test_validate_once_remembers_only_what_passed(spill_home, identity):
    doc = {"schema_version": 1, **identity}
    raw = json.dumps(doc).encode()
    validate_once(raw, doc, "row-identity", "x")
    assert len(_markers(spill_home)) == 1
    validate_once(raw, {"not": "checked again"}, "row-identity", "x")  # the same bytes passed
    bad = {"schema_version": 1, "model": identity["model"]}
    for _ in range(2):  # a failure is not remembered: it fails every time
        with pytest.raises(SchemaInvalid, match="input"):
            validate_once(json.dumps(bad).encode(), bad, "row-identity", "x")
    assert len(_markers(spill_home)) == 1
    calls = []
    validate_once(raw + b" ", doc, "row-identity", "x", also=calls.append)  # other bytes
    assert calls == [doc] and len(_markers(spill_home)) == 2


def test_validate_once_still_validates_where_home_is_read_only(spill_home, identity, monkeypatch):
    monkeypatch.setenv("SPILL_HOME", str(spill_home / "file"))
    (spill_home / "file").write_text("not a folder")
    doc = {"schema_version": 1, **identity}
    for _ in range(2):
        validate_once(json.dumps(doc).encode(), doc, "row-identity", "x")
    with pytest.raises(SchemaInvalid):
        validate_once(b"{}", {}, "row-identity", "x")


def test_validate_once_keeps_a_bounded_number_of_markers(spill_home, identity, monkeypatch):
    monkeypatch.setattr(validation, "KEEP_MARKERS", 4)
    doc = {"schema_version": 1, **identity}
    for i in range(9):
        validate_once(json.dumps(doc).encode() + b" " * i, doc, "row-identity", "x")
    assert 2 <= len(_markers(spill_home)) <= 4


def test_remember_records_what_a_writer_validated(spill_home):
    raw = b'{"written": "by spill"}'
    remember(raw, "row-identity")
    validate_once(raw, {"written": "by spill"}, "row-identity", "x")  # trusted: not validated
    with pytest.raises(SchemaInvalid):
        validate_once(raw + b"\n", {"written": "by spill"}, "row-identity", "x")
