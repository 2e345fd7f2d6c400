"""``model:`` and ``teacher:``, the student and the teacher, each with its quantized copy's
settings (``BITS`` and ``GROUP_SIZES`` are spill.models.quant's, declared here, the floor both
import)."""

from __future__ import annotations

from dataclasses import dataclass

from spill.settings.field import PATH, outside_enum, setting

BITS = (4, 8)  # bit widths spill writes and reads (whole words of 8 or 4 values)
GROUP_SIZES = (32, 64, 128)  # what mlx's kernels take (spill.models.quant reads 16 too)
QUANTIZATION = ("quantize", "group_size")  # inputs of a stage only when quantize is set
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
_MODEL = {"minLength": 1, "maxLength": 4096, "pattern": PATH + "/?$"}


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
        return outside_enum(self, QUANTIZATION, name)


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
