"""The groups of spill.yaml, by name (``GROUPS``), with the small ones (``data:``, ``eval:``,
``prompt:``) and the stage inputs the deciding settings make."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spill.settings.engine import EngineSettings
from spill.settings.export import ExportSettings
from spill.settings.field import PATH, deciding, setting
from spill.settings.model import QUANTIZATION, ModelSettings, TeacherSettings
from spill.settings.tune import PREFERENCE, VALIDATION, TuneSettings


def stage_inputs(group: str, values) -> dict[str, Any]:
    """The deciding settings of ``values`` (a group's dataclass) as a stage's inputs
    (``model.name``); a quantized copy's ``quantize`` and ``group_size`` only when ``quantize``
    is set, so a float model's stages keep the inputs they had before quantized bases; the
    validation settings only when ``tune.valid`` is set, the preference ones only for a
    preference tune, for the same reason."""
    keys = deciding(type(values))
    if getattr(values, "quantize", None) is None:
        keys = tuple(k for k in keys if k not in QUANTIZATION)
    if hasattr(values, "valid") and values.valid is None:  # no validation: the inputs of before
        keys = tuple(k for k in keys if k not in VALIDATION)
    if getattr(values, "method", None) == "sft":  # supervised: the inputs of before preference
        keys = tuple(k for k in keys if k not in PREFERENCE)
    return {f"{group}.{k}": getattr(values, k) for k in keys}


@dataclass(frozen=True)
class DataSettings:
    file: str = setting(
        {
            "type": "string",
            "minLength": 1,
            "maxLength": 4096,
            "pattern": PATH + "$",
            "description": "CSV or JSONL file, relative to the project folder (a path: no name "
            "over 255 bytes, no NUL)",
        }
    )
    input: str = setting(
        {"type": "string", "minLength": 1, "description": "the column or key the model reads"}
    )
    output: str = setting(
        {"type": "string", "minLength": 1, "description": "the column or key it answers with"}
    )
    rejected: str | None = setting(  # None: no preference pairs (the inputs of before)
        {
            "type": ["string", "null"],
            "minLength": 1,
            "description": "the column or key of a worse answer: each row a preference pair "
            "(output the chosen answer), trained by tune.method dpo or orpo and graded on "
            "preference accuracy; null: none",
        }
    )
    task: str = setting(  # "auto", "classification" or "generation"
        {
            "enum": ["auto", "classification", "generation"],
            "description": "classification: a closed label set; generation: free text",
        }
    )
    test_fraction: float = setting(
        {
            "type": "number",
            "exclusiveMinimum": 0,
            "exclusiveMaximum": 1,
            "description": "share of rows held out for grading",
        }
    )


@dataclass(frozen=True)
class EvalSettings:
    max_new_tokens: int | None = setting(  # None: the longest answer + 16
        {"type": ["integer", "null"], "minimum": 1},
        "generation limit (default: the longest answer's tokens + 16)",
    )
    batch: int | None = setting(  # None: from the memory budget
        {"type": ["integer", "null"], "minimum": 1},
        "rows graded together (default: as many as the memory budget fits, at most 64)",
        decides=False,
    )


@dataclass(frozen=True)
class PromptSettings:
    template: str = setting(
        {
            "type": "string",
            "pattern": "\\{input\\}",
            "description": "must contain {input}; {labels} is the label set",
        }
    )
    chat: bool = setting({"type": "boolean"})


GROUPS: dict[str, type] = {
    "data": DataSettings,
    "model": ModelSettings,
    "teacher": TeacherSettings,
    "tune": TuneSettings,
    "eval": EvalSettings,
    "engine": EngineSettings,
    "prompt": PromptSettings,
    "export": ExportSettings,
}
