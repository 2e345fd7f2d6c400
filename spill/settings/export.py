"""``export:``, the group of the build's export stage: the merged models to write after
``tune``, with ``spill export``'s options (``spill.jobs.export`` and the verb read these)."""

from __future__ import annotations

from dataclasses import dataclass

from spill.settings.field import setting
from spill.settings.model import BITS

EXPORT_FORMATS = ("hf", "gguf", "mlx")  # what spill.jobs.export writes (``spill export`` too)
EXPORT_DTYPES = ("f32", "bf16", "f16")
# the formats that take a quantization: the GGUF's block kinds; mlx-lm's affine bits, spill's own
EXPORT_QUANTIZE = {"gguf": ("q8_0", "q4_0", "q4_1"), "mlx": BITS}


@dataclass(frozen=True)
class ExportSettings:
    """``export:``, the merged models the export stage writes after ``tune`` (``spill
    export``'s options; docs/export.md). Every setting decides the stage's result."""

    formats: tuple[str, ...] = setting(
        {
            "type": "array",
            "items": {"enum": list(EXPORT_FORMATS)},
            "uniqueItems": True,
            "description": "merged models to write under <state>/exports/<name>/<format>: hf "
            "(transformers, vLLM), gguf (llama.cpp, Ollama), mlx (mlx-lm); []: no export stage",
        },
        flag=False,
    )
    dtype: str | None = setting(
        {
            "enum": [None, *EXPORT_DTYPES],
            "description": "the float dtype written; null: the base's own, else bf16",
        },
        flag=False,
    )
    quantize: str | int | None = setting(
        {
            "enum": [None, *(q for qs in EXPORT_QUANTIZE.values() for q in qs)],
            "description": "q8_0, q4_0, q4_1: the GGUF's matrices; 4, 8: mlx-lm's affine bits; "
            "the other formats are written in dtype; null: none",
        },
        flag=False,
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "formats", tuple(self.formats))

    def quantize_for(self, fmt: str) -> str | None:
        """What ``spill export --quantize`` is for format ``fmt`` (None: written in dtype)."""
        return str(self.quantize) if self.quantize in EXPORT_QUANTIZE.get(fmt, ()) else None

    def problem(self, name=lambda key: key) -> str:
        """A ``quantize`` that none of the ``formats`` takes, said in one line (``""``: none)."""
        if self.quantize is None or any(self.quantize_for(f) for f in self.formats):
            return ""
        takes = [f for f, qs in EXPORT_QUANTIZE.items() if self.quantize in qs]
        return (
            f"{name('quantize')} {self.quantize!r} applies to {', '.join(takes)} only, which "
            f"{name('formats')} {list(self.formats)} leaves out; add it or set quantize to null"
        )
