"""JSON Schema validation for the files the store writes and reads.

Schemas are draft 2020-12 files in ``spill/schemas/<name>.schema.json``, loaded through
``importlib.resources`` so they work from a wheel as well as from a checkout. A document that
does not validate is refused in one line that names the file kind, the failing field and why.
"""

from __future__ import annotations

import json
from functools import cache
from importlib.resources import files
from typing import Any

from spill.errors import StoreError

SUFFIX = ".schema.json"


class SchemaInvalid(StoreError):
    """A stored document that does not match its JSON Schema."""


@cache
def _validator(name: str):
    import jsonschema

    resource = files("spill") / "schemas" / f"{name}{SUFFIX}"
    try:
        schema = json.loads(resource.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"no schema named {name!r} in spill/schemas") from None
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def load_schema(name: str) -> dict:
    """The schema ``name`` (``"commit"`` or ``"commit.schema.json"``) as a dict."""
    return _validator(name.removesuffix(SUFFIX)).schema


def validate(doc: Any, name: str, where: str | None = None) -> None:
    """Raise ``SchemaInvalid`` unless ``doc`` matches schema ``name``; ``where`` names the file."""
    name = name.removesuffix(SUFFIX)
    from jsonschema.exceptions import best_match

    error = best_match(_validator(name).iter_errors(doc))
    if error is None:
        return
    field = "/".join(str(p) for p in error.absolute_path) or "(top level)"
    label = where or f"a {name} document"
    raise SchemaInvalid(
        f"{label} does not match the {name} schema at {field}: {error.message}; "
        "it was written by another version or damaged, so it is not used"
    )
