"""The export stage: the tuned adapter merged into its base and written in each format of
``export.formats`` (``spill export``'s writers), under ``<state>/exports/<name>/<format>/``.

Progress is the formats committed. Its job (``spill.jobs.export.export_formats``) has
``spill export`` fill each folder and commits, through the build's run, a payload holding that
format's ``export.json`` (its files' sizes and sha256, who made it). The job state holds
records, not models: a deleted or changed export is made again (the plan runs the stage
afresh), never restored from it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from spill.project.build.outputs import sha256_of
from spill.project.build.stages.base import Stage, distinct
from spill.store.fs import files_under, get_bytes, join, stat
from spill.store.location import Location

if TYPE_CHECKING:  # types only: a finished build and `spill status` load none of these
    from spill.project.build.context import BuildContext
    from spill.project.build.stages.spec import StageSpec
    from spill.project.config import Project
    from spill.project.data import Prepared


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
        from spill.jobs.authority import Writer
        from spill.jobs.export import FormatsOptions, export_formats
        from spill.jobs.group import current

        if not current().leader:  # one process merges; the others of a group have nothing to do
            return {}, True
        p, tuned = ctx.project, self.upstream[0]
        opts = FormatsOptions(
            settings=p.export,
            out=join(ctx.root, self.output(p.name)),
            adapter_name=tuned.output(p.name),
            model=p.model.name,
            work=ctx.work,
            writer=Writer(state=self.uri(ctx.root), place=self.place(ctx.root, ctx.run)),
            weights=tuned.weights(p),
            stop_after=stop,
        )
        return export_formats(ctx.local_folder(tuned.output(p.name), tuned.files), opts)

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

    def probe(self, root: Location) -> tuple[int, list[dict]]:
        from spill.jobs.export import records

        recs = records(self.place(root))
        return len(recs), distinct([r.get("producer") or {} for r in recs.values()])

    def ranges(self, root: Location) -> list[dict[str, Any]]:
        from spill.jobs.export import records

        recs = list(records(self.place(root)).values())
        return [
            {"from": i, "to": i + 1, "producer": distinct([r.get("producer") or {}])[0]}
            for i, r in enumerate(recs)
        ]

    def pinned(self, root: Location) -> dict[str, Any] | None:
        from spill.jobs.export import records

        recs = list(records(self.place(root)).values())
        base = recs[0]["export"].get("base") if recs else None
        if not isinstance(base, dict):
            return None
        keys = {"id": "name", "fingerprint": "fingerprint", "quantization": "quantization"}
        return {k: base.get(v) for k, v in keys.items()}

    def record(self, root: Location, project: str) -> dict[str, dict[str, Any]]:
        """Each file's size and sha256 from the export.json beside it (hashed when written:
        models are large), the export.json itself hashed; mtimes from the store."""
        from spill.jobs.export import RECORD

        where, out = self.output(project), {}
        for fmt_rec in sorted(files_under(join(root, where))):
            if fmt_rec.rsplit("/", 1)[-1] != RECORD or fmt_rec.count("/") != 1:
                continue
            fmt = fmt_rec.split("/")[0]
            data = get_bytes(join(root, where, fmt_rec))
            listed = {
                **json.loads(data)["files"],
                RECORD: {"size": len(data), "sha256": sha256_of(data)},
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

    def source(self, root: Location, total: int) -> str:
        return ""  # exports are made again, not restored: see the module doc
