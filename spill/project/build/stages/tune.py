"""The tune stage: trains the adapter; progress is the newest committed checkpoint's step."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from spill.project.build import outputs
from spill.project.build.stages.base import Stage, common_inputs, distinct
from spill.settings import stage_inputs
from spill.store.fs import join
from spill.store.location import Location

if TYPE_CHECKING:  # types only: a finished build and `spill status` load none of these
    from spill.project.build.context import BuildContext
    from spill.project.build.stages.spec import StageSpec
    from spill.project.config import Project
    from spill.project.data import Prepared


# a preference tune's last-step metrics the build's table shows (TRL's names)
PREFERENCE_SHOWN = {"rewards/accuracies": "reward accuracy", "rewards/margins": "margin"}


class TuneStage(Stage):
    """Trains the adapter on the training rows, or on the teacher's answers when the stage it
    reads (``distill``) runs."""

    unit: ClassVar[str] = "step"
    marker: ClassVar[str] = "params.safetensors"
    exported: ClassVar[str] = "adapter"  # where the tune job exports, inside its folder
    files: ClassVar[tuple[str, ...]] = ("params.safetensors", "adapter.json")  # what eval loads

    def inputs(
        self, project: Project, prepared: Prepared, earlier: Mapping[str, StageSpec]
    ) -> dict[str, Any]:
        from spill.project.data import sha256

        out = {**common_inputs(project, prepared), **stage_inputs("tune", project.tune)}
        if prepared.n_valid:
            out["data:valid.jsonl"] = sha256(prepared.valid)
        teacher = earlier.get(self.needs[0])
        if teacher is not None and teacher.enabled:  # it trains on the teacher's answers
            out[f"stage:{teacher.name}"] = teacher.fingerprint
        else:
            out["data:train.jsonl"] = sha256(prepared.train)
        return out

    def total(self, project: Project, prepared: Prepared) -> int:
        return project.tune.steps

    def execute(self, ctx: BuildContext, stop: int | None) -> tuple[dict[str, Any], bool]:
        from spill.jobs.tune import TuneOptions, tune

        p, t = ctx.project, ctx.project.tune
        job = self.job_options(ctx, t.batch, stop)
        opts = TuneOptions(
            tune=t,
            seed=p.seed,
            engine=job.engine,
            stop_after=job.stop_after,
            weights=job.weights,
            writer=job.writer,
            quantize=job.quantize,
            valid=ctx.work / "valid.jsonl" if ctx.prepared.n_valid else None,
            track=ctx.track,
        )
        s = tune(p.model.name, self.train_file(ctx), p.name, opts)
        kept = ("valid_loss", "best_step", "best_valid_loss", *PREFERENCE_SHOWN)
        watched = {k: s[k] for k in kept if k in s}
        result = {"step": s["step"], "steps": t.steps, "loss": s["loss"], **watched}
        return result, s["step"] == t.steps

    def train_file(self, ctx: BuildContext) -> Path:
        """The rows it trains on: the split's training rows, or the teacher's answers."""

        teacher = self.upstream[0]
        if teacher.off(ctx.project):
            return ctx.work / "train.jsonl"
        return ctx.fetch(teacher.output(ctx.project.name))

    def output(self, project: str) -> str:
        return f"adapters/{project}"

    def summarize(self, result: Mapping[str, Any]) -> str:
        if not result:
            return ""
        loss, valid = result.get("loss"), result.get("valid_loss")
        best = result.get("best_step")
        return (
            f"{result['step']} of {result['steps']} steps"
            + (f", loss {loss:.4f}" if loss is not None else "")
            + (f", validation {valid:.4f}" if valid is not None else "")
            + (f", exported step {best}" if best else "")
            + "".join(
                f", {label} {result[k]:.3f}" for k, label in PREFERENCE_SHOWN.items() if k in result
            )
        )

    def count_name(self) -> str:
        return f"{self.name}.steps"

    def probe(self, root: Location) -> tuple[int, list[dict]]:
        from spill.payloads.newest import newest_commit

        found = newest_commit(self.place(root))
        if found is None:
            return 0, []
        step, state = found
        return step, distinct(state.get("producers") or [])

    def ranges(self, root: Location) -> list[dict[str, Any]]:
        from spill.payloads.newest import newest_commit

        found = newest_commit(self.place(root))
        given = (found[1].get("producers") if found else None) or []
        return [
            {"from": p["from_step"], "to": p["to_step"], "producer": distinct([p])[0]}
            for p in given
            if isinstance(p, dict) and isinstance(p.get("from_step"), int)
        ]

    def pinned(self, root: Location) -> dict[str, Any] | None:
        from spill.payloads.newest import newest_commit

        found = newest_commit(self.place(root))
        model = found[1].get("model") if found else None
        return model if isinstance(model, dict) else None

    def _source(self, done: int) -> str:
        return f"{self.name} step {done} checkpoint"

    def publish(self, root: Location, project: str) -> None:
        outputs.copy_tree(join(self.uri(root), self.exported), join(root, self.output(project)))

    def restore(self, root, project, inputs, recorded) -> None:
        outputs.restore_adapter(
            self.place(root),
            join(self.uri(root), self.exported),
            root,
            self.output(project),
            recorded,
        )
