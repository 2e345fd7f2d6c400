"""One shape per settings group: the frozen dataclasses a project holds, a job embeds and the
command line's flags are made from, each field carrying what the other readers need.

A setting is one field here (``spill.settings_field.setting``: its type, its JSON Schema
fragment, whether it decides a result, its flag's help; the export group's in
``spill.settings_export``) plus one line in the group's base option in ``conf/`` (its default, the only
place a default lives). From these:

* ``spill.project.config`` freezes a composed spill.yaml into these classes;
* the jobs embed them (``TuneOptions.tune``; ``LoadOptions`` is the engine group less the
  engine's name, so an ``EngineSettings`` is what an engine opens a model with);
* the flags of ``spill tune``, ``eval``, ``run`` and ``distill`` are made from the fields
  (``spill.cli.options.setting_flags``), their defaults read from ``conf/``;
* the group sections of ``schemas/spill-yaml.schema.json`` are what
  ``spill.settings_schema.schema_sections`` makes (``python -m spill.settings`` writes them; a
  test compares the shipped file);
* the stages' inputs (``spill.project.stages``) take the fields that decide a result.

Engine-free and light: dataclasses only, no YAML, no jsonschema.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from spill.settings_export import (  # noqa: F401  (part of this module's API)
    EXPORT_DTYPES,
    EXPORT_FORMATS,
    EXPORT_QUANTIZE,
    ExportSettings,
)
from spill.settings_field import deciding, meta, setting  # noqa: F401

ACTIVATIONS = ("auto", "keep", "recompute")
TRACKERS = ("tensorboard", "mlflow")  # spill.jobs.track's kinds
_LOG = {  # tune.log: a list in spill.yaml
    "type": "array",
    "items": {"enum": list(TRACKERS)},
    "uniqueItems": True,
    "description": "trackers the run logs to: tensorboard (event files under the project), "
    "mlflow (MLFLOW_TRACKING_URI); docs/watching.md",
}
_PATH = "^/?[^/\\u0000]{1,255}(/[^/\\u0000]{1,255})*"  # no name over 255 bytes, no NUL
_TARGETS = "(q|k|v|qkv|o|gate|up|gate_up|down)_proj"


def stage_inputs(group: str, values) -> dict[str, Any]:
    """The deciding settings of ``values`` (a group's dataclass) as a stage's inputs
    (``model.name``); a quantized copy's ``quantize`` and ``group_size`` only when ``quantize``
    is set, so a float model's stages keep the inputs they had before quantized bases; the
    validation settings only when ``tune.valid`` is set, for the same reason."""
    keys = deciding(type(values))
    if getattr(values, "quantize", None) is None:
        keys = tuple(k for k in keys if k not in QUANTIZATION)
    if hasattr(values, "valid") and values.valid is None:  # no validation: the inputs of before
        keys = tuple(k for k in keys if k not in VALIDATION)
    return {f"{group}.{k}": getattr(values, k) for k in keys}


@dataclass(frozen=True)
class DataSettings:
    file: str = setting(
        {
            "type": "string",
            "minLength": 1,
            "maxLength": 4096,
            "pattern": _PATH + "$",
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


BITS = (4, 8)  # spill.models.quant's bit widths and mlx's group sizes (a test keeps them equal)
GROUP_SIZES = (32, 64, 128)
# a model's quantized copy (the student's ``model.*``, the teacher's ``teacher.*``)
_QUANTIZE = {
    "enum": [None, *BITS],
    "description": "null: the float weights; 4 or 8: compute on the model's affine copy "
    "<name>@q<bits>g<group_size>, made in the cache on first use",
}
_GROUP_SIZE = {
    "enum": list(GROUP_SIZES),
    "description": "values per scale and bias of the quantized copy (with quantize)",
}
_MODEL = {"minLength": 1, "maxLength": 4096, "pattern": _PATH + "/?$"}


@dataclass(frozen=True)
class ModelSettings:
    """``model:``, the student the project tunes (a model's architecture is
    ``spill.models.config.ModelConfig``)."""

    name: str = setting(
        {
            "type": "string",
            **_MODEL,
            "description": "alias (smollm2:135m), hub id, local folder or tiny:<family>:<seed> "
            "(a folder: no name over 255, no NUL)",
        },
        flag=False,
    )
    quantize: int | None = setting(  # None: the float weights
        _QUANTIZE,
        "compute on the model's 4- or 8-bit affine copy <name>@q<bits>g<group>, made on first "
        "use (default: the float weights)",
    )
    group_size: int = setting(
        _GROUP_SIZE, "values per scale and bias of the --quantize copy (default %(default)s)"
    )

    def problem(self, name=lambda key: key) -> str:
        """What no quantized copy can be made with (``""``: nothing), each setting called
        ``name(key)`` (``model.quantize``, ``--quantize``): the schema's enums, for the flags."""
        return _outside_enum(self, QUANTIZATION, name)


def _outside_enum(obj, keys: tuple[str, ...], name) -> str:
    """The first of ``keys`` whose value is not in its schema's enum, said in one line."""
    for f in dataclasses.fields(obj):
        allowed = f.metadata["schema"].get("enum")
        value = getattr(obj, f.name)
        if f.name in keys and allowed is not None and value not in allowed:
            shown = [str(a) for a in allowed if a is not None]
            choice = ", ".join(shown[:-1]) + " or " + shown[-1] if len(shown) > 1 else shown[0]
            return f"{name(f.name)} {value!r} is not one spill makes: use {choice}"
    return ""


@dataclass(frozen=True)
class TeacherSettings:
    name: str | None = setting(
        {
            "type": ["string", "null"],
            **_MODEL,
            "description": "null: no teacher, the distill stage is skipped",
        },
        flag=False,
    )
    max_new_tokens: int = setting({"type": "integer", "minimum": 1})
    temperature: float = setting(
        {"type": "number", "minimum": 0}, "0 is greedy (default %(default)s)"
    )
    batch: int | None = setting(  # None: from the memory budget
        {"type": ["integer", "null"], "minimum": 1},
        "rows generated together (default: as many as the memory budget fits, at most 64)",
        decides=False,
    )
    # the teacher's quantized copy; the verbs' --quantize is the model group's (one flag each)
    quantize: int | None = setting(_QUANTIZE, flag=False)
    group_size: int = setting(_GROUP_SIZE, flag=False)


QUANTIZATION = ("quantize", "group_size")  # inputs of a stage only when quantize is set
VALIDATION = ("valid", "eval_every", "keep_best")  # inputs of a stage only when valid is set


LR_MAX = 1e37  # AdamW's first step is lr / (1 - beta1) = 10 x lr; float32 ends at 3.4e38


@dataclass(frozen=True)
class TuneSettings:
    """``tune:``, the LoRA training of the student; ``spill tune`` takes each as a flag."""

    steps: int = setting(
        {"type": "integer", "minimum": 1}, "total optimizer steps (default %(default)s)"
    )
    lr: float = setting(  # past LR_MAX AdamW's first step overflows float32 (a traceback)
        {"type": "number", "exclusiveMinimum": 0, "maximum": LR_MAX},
        "peak learning rate (default %(default)s)",
    )
    warmup: int = setting({"type": "integer", "minimum": 0}, "warmup steps before the cosine decay")
    weight_decay: float = setting({"type": "number", "minimum": 0})
    rank: int = setting({"type": "integer", "minimum": 1}, "LoRA rank (default %(default)s)")
    alpha: float | None = setting(  # None: 2 x rank (``LoraConfig``)
        {"type": ["number", "null"], "exclusiveMinimum": 0, "description": "null: 2 x rank"},
        "LoRA alpha (default: 2 x rank)",
    )
    dropout: float = setting(
        {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
        "LoRA dropout (default %(default)s)",
    )
    targets: str = setting(  # comma-separated modules, or "all"
        {
            "type": "string",
            "pattern": f"^(all|all-linear|({_TARGETS})(\\s*,\\s*{_TARGETS})*)$",
            "description": "comma-separated q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
            "down_proj (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj), or all",
        },
        "modules to adapt, comma-separated, or 'all' (default %(default)s)",
    )
    batch: int = setting(
        {"type": "integer", "minimum": 1}, "samples per optimizer step (default %(default)s)"
    )
    micro_batch: int = setting(  # batch // micro_batch micro-batches are accumulated
        {"type": "integer", "minimum": 1},
        "samples per forward pass; --batch must be a multiple (default %(default)s)",
    )
    seq_len: int = setting(
        {"type": "integer", "minimum": 2},
        "tokens per sample, longer rows are cut (default %(default)s)",
    )
    ckpt_every: int = setting(
        {"type": "integer", "minimum": 1},
        "steps between checkpoints (default %(default)s)",
        decides=False,
    )
    activations: str = setting(
        {
            "enum": list(ACTIVATIONS),
            "description": "keep a step's activations (no recompute) or recompute them in "
            "backward; auto: kept when the layers are resident and they fit the memory budget. "
            "The result is the same bits either way",
        },
        "keep a step's activations or recompute them in backward; auto keeps them when they "
        "fit the memory budget; the same result either way (default %(default)s)",
        decides=False,
    )
    valid: float | None = setting(  # the file itself: ``spill tune --valid FILE``
        {
            "type": ["number", "null"],
            "exclusiveMinimum": 0,
            "description": "validation rows carved off the training split (never the test "
            "rows): a count (1 or more) or a fraction (below 1); null: no validation",
        },
        flag=False,
    )
    eval_every: int = setting(
        {"type": "integer", "minimum": 1},
        "steps between validation losses, and the last step (default %(default)s)",
    )
    keep_best: bool = setting(
        {"type": "boolean"},
        "export the checkpoint with the lowest validation loss, not the last (needs validation)",
    )

    log: tuple[str, ...] = setting(_LOG, decides=False, flag=False)  # the verbs: --log a,b

    def __post_init__(self) -> None:
        object.__setattr__(self, "log", tuple(self.log))  # frozen and hashable from a YAML list

    def problem(self, name=lambda key: key) -> str:
        """What makes these settings unusable together (``""``: nothing), each setting called
        ``name(key)`` (``tune.batch``, ``--batch``): the one check of what a schema cannot say."""
        if self.micro_batch >= 1 and self.batch % self.micro_batch:
            return (
                f"{name('batch')} {self.batch} must be a multiple of {name('micro_batch')} "
                f"{self.micro_batch}"
            )
        if not 0 < self.lr <= LR_MAX:  # NaN too, which a schema's bounds let through
            return (
                f"{name('lr')} {self.lr:g}: a learning rate is a number above 0 and at most "
                f"{LR_MAX:g} (AdamW's steps overflow past it); tunes use about 1e-5 to 1e-2"
            )
        if self.valid is not None and self.valid >= 1 and self.valid != int(self.valid):
            return (
                f"{name('valid')} {self.valid}: a row count is a whole number (a fraction is "
                "below 1)"
            )
        return ""


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
class LoadOptions:
    """How an engine holds a model: the engine group less the engine's name."""

    ring: int | None = None  # force this many layer slots (2 = the streaming test case)
    resident: bool = False  # load every layer once and keep it
    memory: int | str | None = None  # budget for the ring (bytes, or "8G"); None: from free RAM
    device: str | None = None  # "cpu", "cuda", "cuda:1"; None: the engine's best
    dtype: str | None = None  # "float32" or "bfloat16" for base weights; None: measured choice
    # 4-bit layers through torch's int4 weight-only matmul (CPU, bf16, no gradient), not a float
    # copy: other numbers than the dequantized path, named ``bfloat16+int4mm`` where recorded
    packed_matmul: bool = False

    @property
    def budget(self) -> int | None:
        """``memory`` in bytes."""
        from spill.ground.sizes import parse_size

        return parse_size(self.memory) if isinstance(self.memory, str) else self.memory


_LOAD_SCHEMA = {
    "device": {"type": ["string", "null"]},
    "dtype": {"enum": ["float32", "bfloat16", None]},
    "ring": {"type": ["integer", "null"], "minimum": 1},
    "resident": {"type": "boolean"},
    "memory": {
        "type": ["string", "integer", "null"],
        "pattern": "^\\s*\\d+(\\.\\d+)?\\s*[kKmMgGtT]?[iI]?[bB]?\\s*$",
        "minimum": 1,
        "description": "e.g. 8G or 512M; null: from free RAM",
    },
    "packed_matmul": {
        "type": "boolean",
        "description": "4-bit layers through torch's int4 matmul (CPU, bfloat16; row jobs)",
    },
}


@dataclass(frozen=True, kw_only=True)
class EngineSettings(LoadOptions):
    """``engine:``, where the stages compute: nothing here changes what a stage means."""

    name: str = "auto"  # auto, torch or mlx
    procs: int = 1  # processes a build's jobs run as (torch's elastic launcher): docs/procs.md

    def load(self) -> LoadOptions:
        return LoadOptions(
            self.ring, self.resident, self.memory, self.device, self.dtype, self.packed_matmul
        )


ENGINE_FIELDS = (
    "name",
    "device",
    "dtype",
    "ring",
    "resident",
    "memory",
    "packed_matmul",
    "procs",
)  # spill.yaml's order


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
# conf/: the option each group's others extend (model/custom names no model: its ``???``)
BASE = {
    "model": "custom",
    "tune": "default",
    "eval": "default",
    "teacher": "none",
    "engine": "auto",
    "export": "none",
}


if __name__ == "__main__":  # ``python -m spill.settings``: write the schema's group sections
    from spill.settings_schema import write_schema

    write_schema()
