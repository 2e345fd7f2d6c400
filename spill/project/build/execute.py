"""The thin executor of a build plan: each working decision becomes one job call
(``Stage.execute`` through the build's ``BuildContext``); it branches on no stage name.

``state.json`` is written after what it names, so a reader never sees a result whose files are
missing; clearing a stage never removes a payload another run's control object points at; a
signal between jobs stops the build at once. docs/projects.md, "``spill build``".
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

from spill import __version__
from spill.console import note
from spill.errors import DataError, SpillError, StoreError
from spill.ground.machine import anonymous_memory
from spill.jobs.group import current as current_group
from spill.jobs.preempt import (
    Interrupted,
    Preempted,
    critical,
    preempted,
    stop_requested,
    stops_at_once,
)
from spill.project.build import record, tracking
from spill.project.build.context import BuildContext
from spill.project.build.follow import context_of
from spill.project.build.plan import Decision
from spill.project.build.stages import STAGES, get
from spill.project.config import Project
from spill.project.sources import data_sha256
from spill.store.fs import join, put_bytes, remove


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def data_record(project: Project, prepared, data_sha: str) -> dict[str, Any]:
    return {
        "file": project.data.file,
        "sha256": data_sha,
        "rows": prepared.rows,
        "train": prepared.n_train,
        "test": prepared.n_test,
        **({"valid": prepared.n_valid} if prepared.n_valid else {}),
        "task": prepared.task,
        "labels": list(prepared.labels),
    }


class Executor:
    def __init__(self, ctx: BuildContext, doc: dict | None, specs) -> None:
        self.ctx = ctx
        self.project, self.root, self.prepared = ctx.project, ctx.root, ctx.prepared
        self.run = ctx.run  # this build's ownership of its run: every publication goes through it
        self.group = current_group()  # a build of several processes: the others run its jobs too
        self.shared = False  # the context went to the other ranks
        self.held: int | None = None  # under a budget: anonymous bytes before the first job
        self.data_sha = ctx.data_sha
        self.specs = {s.name: s for s in specs}
        tracking.prepare(ctx, self.specs)  # a missing tracker fails before any stage
        self.doc = doc or {
            "schema_version": record.SCHEMA_VERSION,
            "kind": record.KIND,
            "stages": {},
        }
        self.doc.update(
            project={
                "name": ctx.project.name,
                **({"id": ctx.project.id} if ctx.project.id else {}),
            },
            spill_version=__version__,
            compose_key=ctx.key,
            overrides=list(ctx.project.overrides),
            config=ctx.project.to_dict(),
            data=data_record(ctx.project, ctx.prepared, ctx.data_sha),
        )

    # the state document ---------------------------------------------------------------------

    def save(self) -> None:
        self.doc["updated"] = now()
        with critical():
            record.write(self.run, self.doc)

    def _record(self, name: str, status: str, **fields: Any) -> dict:
        spec, stage = self.specs[name], get(name)
        rec = self.doc["stages"].setdefault(name, {})
        rec.update(
            status=status,
            fingerprint=spec.fingerprint,
            inputs=dict(spec.inputs),
            total=spec.total,
            unit=stage.unit,
            location=f"stages/{stage.folder}",
            updated=now(),
            **fields,
        )
        rec.setdefault("progress", 0)
        rec.setdefault("result", {})
        rec.setdefault("producers", [])
        if status == "done":  # what it published, read back, so that a later change shows
            rec["outputs"] = stage.record(self.root, self.project.name)
        else:
            rec.pop("outputs", None)  # only a finished stage claims files
        return rec

    def _probe(self, name: str) -> dict[str, Any]:
        progress, producers = get(name).probe(self.root)
        return {"progress": progress, "producers": producers}

    # running ----------------------------------------------------------------------------------

    def execute(self, decisions: list[Decision]) -> None:
        p = self.project
        note(f"spill build · project {p.name} · state {self.root}")
        for d in decisions:
            note(f"  {d.stage:<9}  {d.action:<8}  {d.reason}")
        self.doc["plan"] = [d.to_dict() for d in decisions]
        for d in decisions:  # records made from other inputs no longer describe anything
            if d.action == "run" or d.drop:
                self.doc["stages"].pop(d.stage, None)
            elif d.action == "skip":
                self._record(d.stage, "skipped")
        if self.ctx.under_budget():  # before any job's first matmul: its stages share a process
            from spill import engines
            from spill.engines.core import heap

            heap.bound_shape_caches()
            # where the process stands before its first job, the engine imported as a job of its
            # own imports it (RUNTIME counts that process)
            with contextlib.suppress(SpillError):  # the first job says it, as without a budget
                engines.resolve(self.project.engine.name)
            self.held = anonymous_memory()
        with stops_at_once(), tempfile.TemporaryDirectory(prefix="spill-build-") as work:
            self.ctx.work = Path(work)
            for name, data in self.prepared.files().items():
                (self.ctx.work / name).write_bytes(data)
            try:
                with critical():  # the split, for people to read
                    for name in ("train.jsonl", "test.jsonl"):
                        data = (self.ctx.work / name).read_bytes()
                        put_bytes(join(self.root, "files", name), data)
                self.save()
                with critical():  # out of date and waiting: not even its files stay
                    for d in decisions:
                        if d.drop and not d.works:
                            self._clear(d.stage)
                for d in decisions:
                    if (why := stop_requested()) is not None:  # from another thread, say
                        self._preempted(why, None)
                    if d.action == "restore":
                        self._restore(d)
                    elif d.works:
                        self._stage(d)
            except Interrupted as e:
                self._preempted(str(e), None)
            finally:
                if self.held is not None:  # nothing carried past the build
                    from spill.engines.core import budget

                    budget.carry(0)

    def _preempted(self, why: str, stage: str | None) -> NoReturn:
        """Record the stopped stage (or nothing new) and raise the build's ``preempted`` line."""
        what = None
        if stage is not None:
            rec = self._record(stage, "stopped", **self._probe(stage))
            what = f"{stage} at {rec['unit']} {rec['progress']} of {rec['total']}"
        self.doc["updated"] = now()
        record.write(self.run, self.doc)
        raise preempted(why, what, who="build") from None

    def _stage(self, d: Decision) -> None:
        from spill.engines.core import budget, heap

        note(f"== {d.stage}: {d.reason}")
        stage = get(d.stage)
        with critical():
            if d.fresh:
                self._clear(d.stage)
            fresh = {"progress": 0, "result": {}, "producers": []} if d.fresh else {}
            self._record(d.stage, "running", **fresh)
        self.save()
        self._check_data(None)
        if self.group.world > 1:  # the other ranks run the job with this one
            if not self.shared:
                self.group.share(("context", context_of(self.ctx)))
                self.shared = True
            self.group.share(("stage", d))
        if self.held is not None:  # what earlier stages left comes out of this one's budget
            budget.carry((anonymous_memory() or 0) - self.held)
        try:
            result, complete = stage.execute(self.ctx, d.stop)
        except Preempted:
            self._preempted(stop_requested() or "a stop request", d.stage)
        except Interrupted as e:
            self._preempted(str(e), d.stage)
        except SpillError:  # the job refused or failed in one line: nothing runs any more
            with critical():
                self._record(d.stage, "stopped", **self._probe(d.stage))
            self.save()
            raise
        heap.release()  # the next stage starts from what this job returned, not what it left
        with critical():
            if complete:
                stage.publish(self.root, self.project.name)
            status = "done" if complete else "stopped"
            self._record(d.stage, status, result=result, **self._probe(d.stage))
        self._check_data(d.stage)
        self.save()
        if (why := stop_requested()) is not None:
            self._preempted(why, None)

    def _check_data(self, stage: str | None) -> None:
        if data_sha256(self.project.data_path) != self.data_sha:
            done = (
                f"{stage} finished with the data read at the start and is recorded; "
                if stage
                else ""
            )
            if stage:
                self.save()
            raise DataError(
                f"{self.project.data_path} changed while the build ran; {done}run spill build "
                "again: the stages that read it start fresh"
            )

    # the stages -------------------------------------------------------------------------------

    def _clear(self, name: str) -> None:
        """Remove a stage's job state and outputs (it starts fresh, or its result is stale);
        the payloads another run's control object points at (a completed parent's) stay."""
        stage = get(name)
        stage.place(self.root, self.run).clear()  # this run's pointers dropped first
        remove(join(self.root, stage.output(self.project.name)))

    def _restore(self, d: Decision) -> None:
        """Publish a done stage's missing or changed outputs again from its committed state."""
        note(f"== {d.stage}: {d.reason}")
        rec, stage = self.doc["stages"][d.stage], get(d.stage)
        with critical():
            try:
                stage.restore(self.root, self.project.name, self.ctx.work, rec.get("outputs"))
            except SpillError as e:  # then the next build recomputes it and what reads it
                gone = {d.stage}
                for later in STAGES:
                    gone |= {later.name} if gone & set(later.needs) else set()
                for name in gone:
                    self.doc["stages"].pop(name, None)
                record.write(self.run, self.doc)
                raise StoreError(
                    f"{d.stage}: its outputs cannot be restored ({e}); run spill build again "
                    "to compute them afresh"
                ) from None
            rec.update(outputs=stage.record(self.root, self.project.name), updated=now())
        self.save()
