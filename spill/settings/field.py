"""What a setting is: a dataclass field whose metadata carries its JSON Schema fragment, its
flag's help, whether it decides a stage's result and how the verbs take it as a flag."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import MISSING, field
from typing import Any

PATH = "^/?[^/\\u0000]{1,255}(/[^/\\u0000]{1,255})*"  # a schema pattern: no name over 255 bytes, no NUL


def setting(
    schema: dict,
    help: str | None = None,
    *,
    decides: bool = True,
    flag: bool | str = True,
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    default: Any = MISSING,
):
    """A field: ``schema`` its JSON Schema fragment (a ``description`` is the file's text),
    ``help`` its flag's help (None: none), ``decides``: a different value gives a different
    result (a stage input), ``flag``: the verbs take it as ``--<name>`` (a string: that flag),
    ``metavar`` and ``parse`` (a flag's text to the value; default: the field's type) for the
    flag. ``default`` only where a seam's dataclass is built without conf/ (a test keeps it
    conf's)."""
    meta = {"schema": schema, "help": help, "decides": decides, "flag": flag}
    return field(default=default, metadata=meta | {"metavar": metavar, "parse": parse})


def flag_name(f: dataclasses.Field) -> str:
    """``--micro-batch`` for ``micro_batch``, or the flag a setting names (``--engine``)."""
    named = f.metadata["flag"]
    return named if isinstance(named, str) else "--" + f.name.replace("_", "-")


def deciding(cls) -> tuple[str, ...]:
    """The settings of a group whose value decides a stage's result."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("decides", True))


def outside_enum(obj, keys: tuple[str, ...], name) -> str:
    """The first of ``keys`` whose value is not in its schema's enum, said in one line."""
    for f in dataclasses.fields(obj):
        allowed = f.metadata["schema"].get("enum")
        value = getattr(obj, f.name)
        if f.name in keys and allowed is not None and value not in allowed:
            shown = [str(a) for a in allowed if a is not None]
            choice = ", ".join(shown[:-1]) + " or " + shown[-1] if len(shown) > 1 else shown[0]
            return f"{name(f.name)} {value!r} is not one spill makes: use {choice}"
    return ""
