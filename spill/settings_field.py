"""What a setting is: a dataclass field whose metadata carries its JSON Schema fragment, its
flag's help, whether it decides a stage's result and whether the job verbs take it as a flag
(``spill.settings`` holds the groups made of them)."""

from __future__ import annotations

import dataclasses
from dataclasses import field
from typing import Any


def setting(schema: dict, help: str | None = None, *, decides: bool = True, flag: bool = True):
    """A field: ``schema`` its JSON Schema fragment (a ``description`` is the file's text),
    ``help`` its flag's help (None: none), ``decides``: a different value gives a different
    result (a stage input), ``flag``: the job verbs take it as ``--<name>``."""
    return field(metadata={"schema": schema, "help": help, "decides": decides, "flag": flag})


def meta(f: dataclasses.Field) -> dict[str, Any]:
    return dict(f.metadata)


def deciding(cls) -> tuple[str, ...]:
    """The settings of a group whose value decides a stage's result."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("decides", True))
