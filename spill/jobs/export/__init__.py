"""``spill export``: a tuned adapter merged into its base and written as a model to deploy
(``export``; a build's export job: ``export_formats``).

``export`` refuses an OUT that is one of its inputs, and records ``export.json`` (format, dtype,
adapter, base fingerprint, every output file's size and sha256) beside the merged model, so a killed
export never leaves something at OUT that looks finished. A quantized base is dequantized for the
merge, and export.json and the printed note say so.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import spill
from spill.console import note
from spill.errors import SpillError, UsageError
from spill.ground.hashing import file_sha256
from spill.ground.paths import spill_home
from spill.ground.validate import parse_json, validate
from spill.jobs.preempt import critical
from spill.jobs.producer import describe
from spill.settings import EXPORT_DTYPES, EXPORT_FORMATS, EXPORT_QUANTIZE
from spill.store import drill
from spill.store.disk import local_folder, same_file
from spill.store.fs import (
    exists,
    fsync,
    get_bytes,
    join,
    put_bytes,
    remove,
    remove_stale,
    stat,
)

if TYPE_CHECKING:  # the merge imports numpy and safetensors: not at `spill --help`
    from spill.control.place import Place
    from spill.jobs.authority import Writer
    from spill.jobs.export.merge import Inputs
    from spill.settings import ExportSettings

FORMATS = EXPORT_FORMATS  # one definition, with spill.yaml's ``export:`` (spill.settings)
DTYPES = EXPORT_DTYPES
QUANTIZE = {fmt: tuple(str(q) for q in kinds) for fmt, kinds in EXPORT_QUANTIZE.items()}
RECORD = "export.json"
SCHEMA_VERSION = 1
POINTER = "formats"  # a build's committed formats' payloads, in the order of export.formats
# what ``producer.describe`` reads of an engine: the merge is numpy's, on the CPU
PRODUCER = {"engine": "numpy", "device": "cpu", "numerics": "float32 merge"}


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
        from spill.jobs.export import hf  # lazy: one format's writer, when asked

        return hf.write
    if fmt == "gguf":
        from spill.jobs.export import gguf  # lazy: one format's writer, when asked

        return gguf.write
    from spill.jobs.export import mlx  # lazy: one format's writer, when asked

    return mlx.write


def check_options(fmt: str, dtype: str | None, quantize: str | None) -> None:
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not one spill writes; use {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise UsageError(f"--dtype {dtype!r} is not one spill writes; use {', '.join(DTYPES)}")
    if quantize is not None and quantize not in QUANTIZE.get(fmt, ()):
        which = ", ".join(f"{k}: {'/'.join(v)}" for k, v in QUANTIZE.items())
        raise UsageError(f"--quantize {quantize} does not apply to --format {fmt} ({which})")


# ``export`` resolves the adapter and its base (``merge.open_inputs``: the fingerprint the adapter
# records must be the base's), refuses an OUT that is one of its inputs, has the format's writer
# fill a temporary folder beside OUT with the merged model (``merge.merged``: float32 merge, then
# the output dtype), records ``export.json`` and renames the folder into place.
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
    from spill.jobs.export.merge import open_inputs  # lazy: one format's writer, when asked

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


@dataclass(frozen=True)
class FormatsOptions:
    """What a build's export job writes (``export.formats`` of ``settings``) and where."""

    settings: ExportSettings
    out: str  # each format's folder goes to <out>/<format> (the state's exports/<project>/)
    adapter_name: str  # the adapter as export.json names it: relative to the state
    model: str  # the base's name, for the note
    work: Path  # a local folder for a format written for an object store
    writer: Writer  # the stage's place in the build's run: where the records commit
    weights: str | None = None  # the model folder a bundle install gave the project
    stop_after: int | None = None  # formats, counting those committed before


def export_formats(adapter: Path, opts: FormatsOptions) -> tuple[dict[str, Any], bool]:
    """A build's export job: each format of ``export.formats`` not committed yet is written
    (``export``) and uploaded where the state is remote, then its ``export.json`` is committed
    as a payload of ``opts.writer``'s place; (the result to record, whether all are). A killed
    build continues at the first format without a payload; a folder in place but not committed
    is written again. One process writes (a build's rank 0)."""
    place, s = opts.writer.place, opts.settings
    assert place is not None, "a build's export job commits in the build's run"
    done = committed(place, opts.out)
    for fmt in s.formats:
        if fmt in done:
            continue
        if opts.stop_after is not None and len(done) >= opts.stop_after:
            return _result(done), False
        dest = join(opts.out, fmt)
        remove(dest)  # written by a build killed before its commit
        note(f"export {fmt}: merging {opts.adapter_name} into {opts.model}")
        with local_folder(dest, opts.work / f"export-{fmt}", last=RECORD) as local:
            record = export(
                adapter,
                local,
                fmt,
                s.dtype,
                s.quantize_for(fmt),
                weights=opts.weights,
                progress=note,
                adapter_name=opts.adapter_name,
            )
        drill.at(drill.EXPORT_WRITTEN)
        done[fmt] = _commit(place, done, fmt, record)
    return _result(done), True


def committed(place: Place, out: str) -> dict[str, dict[str, Any]]:
    """Format -> the committed record of each export whose folder under ``out`` is still what
    it says."""
    return {
        fmt: rec
        for fmt, rec in records(place).items()
        if not _problem(join(out, fmt), rec["export"])
    }


def records(place: Place) -> dict[str, dict[str, Any]]:
    """Format -> its committed record (``uri``: the payload holding it), in commit order."""
    out = {}
    for uri in place.pointer(POINTER):
        try:
            rec = parse_json(get_bytes(join(uri, RECORD)))
        except (FileNotFoundError, ValueError):
            continue  # damaged: that format is written again
        if isinstance(rec, dict) and isinstance(rec.get("export"), dict):
            out[rec["export"].get("format")] = {**rec, "uri": uri}
    return out


def _commit(place: Place, done: dict, fmt: str, record: dict) -> dict[str, Any]:
    """Publish ``fmt``'s record beside those of ``done`` (the formats still intact) and remove
    the payloads no pointer needs any more."""
    rec = {"export": record, "producer": describe(SimpleNamespace(**PRODUCER))}
    with critical():
        uri = place.payload("export", len(done))
        put_bytes(join(uri, RECORD), json.dumps(rec, indent=1, sort_keys=True).encode())
        keep = [*(r["uri"] for r in done.values()), uri]
        place.publish(POINTER, keep)
        place.collect("export", set(keep))
    return {**rec, "uri": uri}


def _result(done: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    out = {}
    for fmt, rec in done.items():
        e = rec["export"]
        out[fmt] = {
            "dtype": e["dtype"],
            "quantize": e["quantize"],
            "files": len(e["files"]),
            "bytes": sum(f["size"] for f in e["files"].values()),
            "dequantized": bool(e["base"]["dequantized"]),
        }
    return {"formats": out}


def _problem(folder: str, record: Mapping[str, Any]) -> str:
    """What differs between the export folder and its committed record (``""``: nothing): its
    export.json must be there, every file it lists at its size."""
    if not exists(join(folder, RECORD)):
        return f"{folder} missing"
    for name, f in (record.get("files") or {}).items():
        got = stat(join(folder, name))
        if got is None or got[0] != f.get("size"):
            return f"{join(folder, name)} missing or changed"
    return ""
