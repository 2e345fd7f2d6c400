"""The group sections of ``schemas/spill-yaml.schema.json``, made from ``spill.settings`` (each
setting's type, bounds and description) and ``conf/`` (the defaults): ``python -m
spill.settings`` writes them into the shipped file, and a test compares the two.
"""

from __future__ import annotations

import dataclasses

from spill.settings import _LOAD_SCHEMA, BASE, ENGINE_FIELDS, GROUPS


def fields(group: str) -> list[tuple[str, dict]]:
    """(name, JSON Schema fragment) of each setting of ``group``, in spill.yaml's order."""
    if group == "engine":
        return (
            [("name", {"enum": ["auto", "torch", "mlx"]})]
            + [(n, _LOAD_SCHEMA[n]) for n in ENGINE_FIELDS[1:-1]]
            + [
                (
                    "procs",
                    {"type": "integer", "minimum": 1, "description": "processes; docs/procs.md"},
                )
            ]
        )
    return [(f.name, dict(f.metadata["schema"])) for f in dataclasses.fields(GROUPS[group])]


def schema_sections() -> dict[str, dict]:
    """The group sections of spill.yaml's JSON Schema: each setting's fragment, and for the
    groups with a base option (``BASE``) its ``default`` read from ``conf/``."""
    from spill.conf import defaults

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
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "schemas" / "spill-yaml.schema.json"
    doc = json.loads(path.read_text())
    doc["properties"].update(schema_sections())
    path.write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote the group sections of {path}")
