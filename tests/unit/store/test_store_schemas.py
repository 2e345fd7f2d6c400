"""The JSON Schemas load from the package, are valid draft 2020-12, and refuse in one line."""

from __future__ import annotations

import jsonschema
import pytest

from spill.store.schemas import SchemaInvalid, load_schema, validate

NAMES = ["checkpoint-state", "commit", "segment-commit", "row-identity"]


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
