"""One shape per settings group: the frozen dataclasses a project holds, a job embeds and the
command line's flags are made from, each field carrying what the other readers need. A setting is
one field (``field.setting``: its type, its JSON Schema fragment, whether it decides a result, its
flag and help) plus one line in the group's base option in ``conf/`` (its default, the only place a
default lives). Engine-free and light: dataclasses only.

This face re-exports the parts: ``model``, ``tune``, ``engine``, ``export`` (a group each),
``groups`` (the small groups and ``GROUPS``), ``field`` (what a setting is) and ``schema``.
"""

from spill.settings.engine import DTYPES, ENGINE_NAMES, EngineSettings, LoadOptions, engine_flags
from spill.settings.export import EXPORT_DTYPES, EXPORT_FORMATS, EXPORT_QUANTIZE, ExportSettings
from spill.settings.field import deciding, flag_name, setting
from spill.settings.groups import (
    GROUPS,
    DataSettings,
    EvalSettings,
    PromptSettings,
    stage_inputs,
)
from spill.settings.model import (
    BITS,
    GROUP_SIZES,
    QUANTIZATION,
    ModelSettings,
    TeacherSettings,
)
from spill.settings.tune import (
    ACTIVATIONS,
    LR_MAX,
    METHODS,
    PREFERENCE,
    TRACKERS,
    VALIDATION,
    TuneSettings,
)

# Readers: ``spill.project.config`` freezes a composed spill.yaml; the jobs embed the groups
# (``TuneOptions.tune``; an engine opens a model with ``LoadOptions``, the engine group less its
# name); the verbs' flags are made from the fields (``spill.cli.options``); ``python -m
# spill.settings`` writes the schema's group sections (``schema.schema_sections``; a test compares
# the shipped file); the stages take the deciding fields as inputs (``stage_inputs``).
__all__ = [
    "ACTIVATIONS",
    "BITS",
    "DTYPES",
    "ENGINE_NAMES",
    "EXPORT_DTYPES",
    "EXPORT_FORMATS",
    "EXPORT_QUANTIZE",
    "GROUPS",
    "GROUP_SIZES",
    "LR_MAX",
    "QUANTIZATION",
    "TRACKERS",
    "VALIDATION",
    "METHODS",
    "PREFERENCE",
    "DataSettings",
    "EngineSettings",
    "EvalSettings",
    "ExportSettings",
    "LoadOptions",
    "ModelSettings",
    "PromptSettings",
    "TeacherSettings",
    "TuneSettings",
    "deciding",
    "engine_flags",
    "flag_name",
    "setting",
    "stage_inputs",
]
