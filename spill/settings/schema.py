"""The group sections of ``schemas/spill-yaml.schema.json``, made from the settings (each
setting's type, bounds and description) and ``conf/`` (the defaults, and the order of a group
with a base option): ``python -m spill.settings`` writes them into the shipped file, and a test
compares the two."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from spill.conf import BASE, defaults
from spill.settings.groups import GROUPS

SCHEMA = Path(__file__).resolve().parents[2] / "schemas" / "spill-yaml.schema.json"


def fields(group: str) -> list[tuple[str, dict]]:
    """(name, JSON Schema fragment) of each setting of ``group``, in spill.yaml's order (its
    base option's in conf/, else the dataclass's)."""
    fragments = {f.name: dict(f.metadata["schema"]) for f in dataclasses.fields(GROUPS[group])}
    order = defaults(group) if group in BASE else fragments
    return [(name, fragments[name]) for name in order]


def schema_sections() -> dict[str, dict]:
    """The group sections of spill.yaml's JSON Schema: each setting's fragment, and for the
    groups with a base option its ``default`` read from ``conf/``."""
    out = {}
    for group in GROUPS:
        given = defaults(group) if group in BASE else {}
        props = {}
        for name, fragment in fields(group):
            known = group in BASE and given[name] != "???"  # ???: the project must set it
            props[name] = {**fragment, **({"default": given[name]} if known else {})}
        out[group] = {"type": "object", "additionalProperties": False, "properties": props}
    return out


def write_schema() -> None:
    """``python -m spill.settings``: write the group sections into the shipped schema file."""
    doc = json.loads(SCHEMA.read_text())
    doc["properties"].update(schema_sections())
    SCHEMA.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote the group sections of {SCHEMA}")
