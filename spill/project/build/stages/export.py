"""The export stage: the tuned adapter merged into its base and written in each format of
``export.formats`` (``spill export``'s writers), under ``<state>/exports/<name>/<format>/``.

Progress is the formats committed. ``spill export`` fills a temporary folder and renames it
into place whole; then the stage publishes, through the build's run, a payload holding that
format's ``export.json`` (its files' sizes and sha256, who made it). A killed build continues at
the first format without one, and a folder renamed into place but not committed is written again.
The job state holds records, not models: a deleted or changed export is made again (the plan
runs the stage afresh), never restored from it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, ClassVar

from spill.project.build.stages.base import Stage, distinct
from spill.store.fs import exists, files_under, get_bytes, join, put_bytes, remove, stat
from spill.store.location import location

if TYPE_CHECKING:
    from spill.control.place import Place
    from spill.project.build.context import BuildContext
    from spill.project.build.stages.spec import StageSpec
    from spill.project.config import Project
    from spill.project.data import Prepared

POINTER = "formats"  # the committed formats' payloads, in the order of export.formats
RECORD = "export.json"  # spill.jobs.export.RECORD: what each payload and output folder holds
# what ``producer.describe`` reads of an engine: the merge is numpy's, on the CPU
PRODUCER = {"engine": "numpy", "device": "cpu", "numerics": "float32 merge"}


class ExportStage(Stage):
    """Writes the merged model in every format of ``export.formats``; skipped without any."""

    unit: ClassVar[str] = "format"
    skipped: ClassVar[str] = "no formats"

    def off(self, project: Project) -> str:
        return "" if project.export.formats else "no formats (export.formats is [])"

    def off_inputs(self) -> dict[str, Any]:
        return {"export.formats": []}

    def inputs(
        self, project: Project, prepared: Prepared, earlier: Mapping[str, StageSpec]
    ) -> dict[str, Any]:
        e = project.export
        tuned = earlier[self.needs[0]]  # the adapter; its inputs name the base it was tuned on
        return {
            "export.formats": list(e.formats),
            "export.dtype": e.dtype,
            "export.quantize": e.quantize,
            f"stage:{tuned.name}": tuned.fingerprint,
        }

    def total(self, project: Project, prepared: Prepared) -> int:
        return len(project.export.formats)

    def output(self, project: str) -> str:
        return f"exports/{project}"

    # its job ----------------------------------------------------------------------------------

    def execute(self, ctx: BuildContext, stop: int | None) -> tuple[dict[str, Any], bool]:
        from spill.console import note
        from spill.jobs.group import current
        from spill.store import drill

        if not current().leader:  # one process merges; the others of a group have nothing to do
            return {}, True
        p, tuned = ctx.project, self.upstream[0]
        adapter = ctx.local_folder(tuned.output(p.name), tuned.files)
        place = self.place(ctx.root, ctx.run)
        done = self.committed(place, ctx.root, p.name)
        weights = tuned.weights(p)
        for fmt in p.export.formats:
            if fmt in done:
                continue
            if stop is not None and len(done) >= stop:
                return self._result(done), False
            dest = join(ctx.root, self.output(p.name), fmt)
            remove(dest)  # written by a build killed before its commit
            here = location(dest).local
            local = Path(location(dest).path) if here else ctx.work / f"export-{fmt}"
            note(f"export {fmt}: merging {tuned.output(p.name)} into {p.model.name}")
            record = _export(adapter, local, fmt, p, weights, tuned.output(p.name))
            if not here:
                _upload(local, dest)
                shutil.rmtree(local)
            drill.at(drill.EXPORT_WRITTEN)
            done[fmt] = self._commit(place, done, fmt, record)
        return self._result(done), True

    def committed(self, place: Place, root: str, project: str) -> dict[str, dict[str, Any]]:
        """Format -> the committed record of each export whose folder is still what it says."""
        out = {}
        for fmt, rec in self._records(place).items():
            folder = join(root, self.output(project), fmt)
            if not _problem(folder, rec["export"]):
                out[fmt] = rec
        return out

    def _records(self, place: Place) -> dict[str, dict[str, Any]]:
        """Format -> its committed record (``uri``: the payload holding it), in commit order."""
        from spill.ground.validate import parse_json

        out = {}
        for uri in place.pointer(POINTER):
            try:
                rec = parse_json(get_bytes(join(uri, RECORD)))
            except (FileNotFoundError, ValueError):
                continue  # damaged: that format is written again
            if isinstance(rec, dict) and isinstance(rec.get("export"), dict):
                out[rec["export"].get("format")] = {**rec, "uri": uri}
        return out

    def _commit(self, place: Place, done: dict, fmt: str, record: dict) -> dict[str, Any]:
        """Publish ``fmt``'s record beside those of ``done`` (the formats still intact) and
        remove the payloads no pointer needs any more."""
        from spill.jobs.preempt import critical
        from spill.jobs.producer import describe

        rec = {"export": record, "producer": describe(SimpleNamespace(**PRODUCER))}
        with critical():
            uri = place.payload("export", len(done))
            put_bytes(join(uri, RECORD), json.dumps(rec, indent=1, sort_keys=True).encode())
            keep = [*(r["uri"] for r in done.values()), uri]
            place.publish(POINTER, keep)
            place.collect("export", set(keep))
        return {**rec, "uri": uri}

    @staticmethod
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

    # its state and outputs --------------------------------------------------------------------

    def summarize(self, result: Mapping[str, Any]) -> str:
        formats = result.get("formats") or {}
        if not formats:
            return ""
        shown = [f"{fmt} {r['quantize'] or r['dtype']}" for fmt, r in sorted(formats.items())]
        size = sum(r["bytes"] for r in formats.values())
        return f"{', '.join(shown)} ({size / 2**20:.1f} MiB)"

    def count_name(self) -> str:
        return f"{self.name}'s formats"

    def probe(self, root: str) -> tuple[int, list[dict]]:
        recs = self._records(self.place(root))
        return len(recs), distinct([r.get("producer") or {} for r in recs.values()])

    def ranges(self, root: str) -> list[dict[str, Any]]:
        recs = list(self._records(self.place(root)).values())
        return [
            {"from": i, "to": i + 1, "producer": distinct([r.get("producer") or {}])[0]}
            for i, r in enumerate(recs)
        ]

    def pinned(self, root: str) -> dict[str, Any] | None:
        recs = list(self._records(self.place(root)).values())
        base = recs[0]["export"].get("base") if recs else None
        if not isinstance(base, dict):
            return None
        keys = {"id": "name", "fingerprint": "fingerprint", "quantization": "quantization"}
        return {k: base.get(v) for k, v in keys.items()}

    def record(self, root: str, project: str) -> dict[str, dict[str, Any]]:
        """Each file's size and sha256 from the export.json beside it (hashed when written:
        models are large), the export.json itself hashed; mtimes from the store."""
        from spill.project.build.outputs import _sha

        where, out = self.output(project), {}
        for fmt_rec in sorted(files_under(join(root, where))):
            if fmt_rec.rsplit("/", 1)[-1] != RECORD or fmt_rec.count("/") != 1:
                continue
            fmt = fmt_rec.split("/")[0]
            data = get_bytes(join(root, where, fmt_rec))
            listed = {
                **json.loads(data)["files"],
                RECORD: {"size": len(data), "sha256": _sha(data)},
            }
            for name, f in sorted(listed.items()):
                path = f"{where}/{fmt}/{name}"
                found = stat(join(root, path))
                sha = f["sha256"] if name == RECORD else "sha256:" + f["sha256"]  # export's: hex
                entry: dict[str, Any] = {"sha256": sha, "size": f["size"]}
                if found is not None and found[1] is not None:
                    entry["mtime_ns"] = found[1]
                out[path] = entry
        return out

    def source(self, root: str, total: int) -> str:
        return ""  # exports are made again, not restored: see the module doc


def _export(adapter: Path, out: Path, fmt: str, p: Project, weights, name: str) -> dict:
    from spill.console import note
    from spill.jobs.export import export

    e = p.export
    quantize = e.quantize_for(fmt)
    return export(
        adapter, out, fmt, e.dtype, quantize, weights=weights, progress=note, adapter_name=name
    )


def _upload(local: Path, dest: str) -> None:
    """A local export folder onto an object store: export.json last, so that a folder with its
    record is a whole one."""
    names = sorted(q.name for q in local.iterdir())
    for name in [n for n in names if n != RECORD] + [RECORD]:
        put_bytes(join(dest, name), (local / name).read_bytes())


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
