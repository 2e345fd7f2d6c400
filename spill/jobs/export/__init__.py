"""``spill export``: a tuned adapter merged into its base and written as a model to deploy.

``export`` resolves the adapter and its base (``merge.open_inputs``: the fingerprint the
adapter records must be the base's), refuses an OUT that is one of its inputs, has the format's
writer fill a temporary folder beside OUT with the merged model (``merge.merged``: float32
merge, then the output dtype), records ``export.json`` (format, dtype, adapter, base
fingerprint, every output file's size and sha256) and renames the folder into place, so a
killed export never leaves something at OUT that looks finished. A quantized base is
dequantized for the merge, and export.json and the printed note say so.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from spill.errors import SpillError, UsageError
from spill.ground.hashing import file_sha256
from spill.ground.paths import spill_home
from spill.ground.validate import validate
from spill.settings import EXPORT_DTYPES, EXPORT_FORMATS, EXPORT_QUANTIZE
from spill.store.fs import fsync, remove_stale, same_file

if TYPE_CHECKING:  # the merge imports numpy and safetensors: not at `spill --help`
    from spill.jobs.export.merge import Inputs

FORMATS = EXPORT_FORMATS  # one definition, with spill.yaml's ``export:`` (spill.settings)
DTYPES = EXPORT_DTYPES
QUANTIZE = {fmt: tuple(str(q) for q in kinds) for fmt, kinds in EXPORT_QUANTIZE.items()}
RECORD = "export.json"
SCHEMA_VERSION = 1


def default_dtype(inputs: Inputs) -> str:
    """The base's own dtype where it is one of ours (config.json's ``torch_dtype``), else bf16."""
    raw = inputs.raw_config
    named = raw.get("torch_dtype") or raw.get("dtype")
    return {"float32": "f32", "float16": "f16"}.get(named, "bf16")


def _inside(a: Path, b: Path) -> bool:
    """Whether ``a`` is ``b`` or lies under it (resolved, so links count)."""
    a, b = a.resolve(), b.resolve()
    return same_file(a, b) or a.is_relative_to(b)


def refuse_out(out: Path, inputs: Inputs) -> None:
    """A usage error when OUT is, holds or lies inside an input or SPILL_HOME (a folder under
    ``models/`` would become the model of that name); a user error when it exists."""
    home = spill_home()
    if _inside(out, home):
        raise UsageError(
            f"OUT {out} lies inside SPILL_HOME ({home.resolve()}), spill's own folder; "
            "export elsewhere"
        )
    for folder, what in (
        (inputs.base_folder, "the base model folder"),
        (inputs.adapter_dir, "the adapter folder"),
    ):
        if _inside(out, folder) or _inside(folder, out):
            raise UsageError(f"OUT {out} is {what} {folder} or overlaps it; export elsewhere")
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise SpillError(f"{out}: already exists; remove it or export into a new folder")


def _writer(fmt: str):
    if fmt == "hf":
        from spill.jobs.export import hf

        return hf.write
    if fmt == "gguf":
        from spill.jobs.export import gguf

        return gguf.write
    from spill.jobs.export import mlx

    return mlx.write


def check_options(fmt: str, dtype: str | None, quantize: str | None) -> None:
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not one spill writes; use {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r} is not one spill writes; use {', '.join(DTYPES)}")
    if quantize is not None and quantize not in QUANTIZE.get(fmt, ()):
        which = ", ".join(f"{k}: {'/'.join(v)}" for k, v in QUANTIZE.items())
        raise UsageError(f"--quantize {quantize} does not apply to --format {fmt} ({which})")


def export(
    adapter: Path,
    out: Path,
    fmt: str = "hf",
    dtype: str | None = None,
    quantize: str | None = None,
    *,
    model: str | None = None,
    weights: str | None = None,
    progress: Callable[[str], object] = lambda line: None,
    adapter_name: str | None = None,
    **writer_options,
) -> dict:
    """Write the merged model of ``adapter`` to the folder ``out``; what export.json records.
    ``adapter_name``: how export.json names the adapter (default: its resolved folder; a build
    names it relative to its state, so that the bytes do not depend on where the state lies)."""
    import spill
    from spill.jobs.export.merge import open_inputs

    check_options(fmt, dtype, quantize)
    out = Path(out)
    inputs = open_inputs(Path(adapter), model, weights, progress)
    refuse_out(out, inputs)
    dtype = dtype or default_dtype(inputs)
    if inputs.dequantized:
        progress(
            f"{inputs.base_name} is quantized ({inputs.quantization['format']}): dequantized "
            "to float32 for the merge"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out, ".exporting")  # what killed exports to out left
    tmp = out.parent / f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.exporting"
    tmp.mkdir()
    try:
        extra = _writer(fmt)(inputs, tmp, dtype, quantize, progress, **writer_options)
        files = {
            p.name: {"size": p.stat().st_size, "sha256": file_sha256(p)}
            for p in sorted(tmp.iterdir())
        }
        record = {
            "schema_version": SCHEMA_VERSION,
            "format": fmt,
            "dtype": dtype,
            "quantize": quantize,
            "spill_version": spill.__version__,
            "adapter": {
                "folder": adapter_name or str(inputs.adapter_dir.resolve()),
                "sha256": inputs.adapter.sha256,
                "lora": inputs.adapter.lora.to_dict(),
            },
            "base": {
                "name": inputs.base_name,
                "fingerprint": inputs.fingerprint,
                "quantization": inputs.quantization,
                "dequantized": inputs.dequantized,
            },
            "files": files,
            **extra,
        }
        validate(record, "export", where=str(out / RECORD))
        (tmp / RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        for p in sorted(tmp.iterdir()):
            fsync(p)
        fsync(tmp)
        try:
            os.replace(tmp, out)  # onto an empty folder too
        except OSError:  # another export filled OUT meanwhile
            raise SpillError(
                f"{out}: already exists; remove it or export into a new folder"
            ) from None
        fsync(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record
