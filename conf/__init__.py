"""spill's Hydra config groups, read through the ``pkg://spill.conf`` search path.

A project's ``spill.yaml`` picks one option per group in its defaults list; the project's own
values and command-line overrides are applied on top (``spill.project.config``). This package
exists so that ``pkg://`` finds the files in a wheel as well as in a checkout.

These files are the one definition of every setting's default: ``defaults(group)`` reads a
group's base option (the one the others extend) for the verbs that take settings as flags, so
``spill tune`` and a build with the same values are the same run. It reads the YAML directly
(a group option's ``defaults`` list names options of its own group), without Hydra, so the CLI
starts fast.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# The option every other option of its group extends: the shipped default of each setting.
BASE = {
    "model": "custom",
    "tune": "default",
    "eval": "default",
    "teacher": "none",
    "engine": "auto",
    "export": "none",
    "data": "default",  # file, input and output are the project's (???); the later keys' defaults
}


@cache
def _option(group: str, option: str) -> dict[str, Any]:
    import yaml

    doc = yaml.safe_load((HERE / group / f"{option}.yaml").read_text(encoding="utf-8")) or {}
    out: dict[str, Any] = {}
    for parent in doc.pop("defaults", []):  # options of the same group, extended in order
        out.update(_option(group, parent))
    return out | doc


def option(group: str, name: str) -> dict[str, Any]:
    """The settings of one shipped option of ``group``, with the options it extends."""
    return dict(_option(group, name))


def defaults(group: str) -> dict[str, Any]:
    """Every setting of ``group`` (model, tune, eval, teacher, engine, export, data) with its
    shipped default (``???``: the project must give it)."""
    return option(group, BASE[group])
