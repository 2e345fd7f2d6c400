"""The row stages: grading a model on the test rows (``eval:base``, ``eval``) and the teacher
answering the training inputs (``distill``). Progress is the rows of committed segments."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from spill.ground.validate import parse_json
from spill.project.build import outputs
from spill.project.build.stages.base import Stage, common_inputs, distinct
from spill.settings import EvalSettings, deciding, stage_inputs
from spill.store.fs import get_bytes, join
from spill.store.location import Location

if TYPE_CHECKING:  # types only: a finished build and `spill status` load none of these
    from spill.project.build.context import BuildContext
    from spill.project.build.stages.spec import StageSpec
    from spill.project.config import Project
    from spill.project.data import Prepared


class RowStage(Stage):
    """A row job; progress is the rows of its committed segments."""

    unit: ClassVar[str] = "row"

    def __init__(self, *, file: str, reads: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.file = file  # what it publishes under files/
        self.reads = reads  # the derived input it reads, which gives the order of its rows

    def output(self, project: str) -> str:
        return f"files/{self.file}"

    def probe(self, root: Location) -> tuple[int, list[dict]]:
        from spill.payloads.rows import commit_markers

        markers = commit_markers(self.place(root))
        rows = sum(int(m.get("count", 0)) for m in markers)
        return rows, distinct([m.get("producer") or {} for m in markers])

    def _source(self, done: int) -> str:
        return f"{done} committed rows"

    def ranges(self, root: Location) -> list[dict[str, Any]]:
        from spill.payloads.rows import commit_markers

        out: list[dict[str, Any]] = []
        at = 0
        for m in commit_markers(self.place(root)):  # in commit order: row positions add up
            count, made = int(m.get("count", 0)), distinct([m.get("producer") or {}])[0]
            if out and out[-1]["producer"] == made and out[-1]["to"] == at:
                out[-1]["to"] = at + count
            elif count:
                out.append({"from": at, "to": at + count, "producer": made})
            at += count
        return out

    def pinned(self, root: Location) -> dict[str, Any] | None:
        from spill.payloads.rows import IDENTITY, ROWS

        try:
            doc = parse_json(get_bytes(join(self.uri(root), ROWS, IDENTITY)))
        except (FileNotFoundError, ValueError):
            return None
        model = doc.get("model") if isinstance(doc, dict) else None
        return model if isinstance(model, dict) else None

    def restore(self, root, project, inputs, recorded) -> None:
        ids, shape = self.order(inputs / self.reads)
        outputs.restore_rows(self.place(root), join(root, self.output(project)), ids, shape)

    def order(self, path: Path) -> tuple[list, Callable[[dict], dict]]:
        """The row ids of its input in order, and how a committed row becomes a line of its file."""
        raise NotImplementedError


class EvalStage(RowStage):
    """Grades a model on the test rows: the base model, or the tuned one (``adapter``: the
    output of the stage it reads)."""

    KEYS = ("rows", "correct", "accuracy", "gold_logprob", "gold_logprob_per_token")
    PAIRS = ("preference_accuracy", "pairs")  # rows with a rejected answer (data.rejected)

    def __init__(self, *, adapter: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.adapter = adapter

    def inputs(
        self, project: Project, prepared: Prepared, earlier: Mapping[str, StageSpec]
    ) -> dict[str, Any]:
        from spill.project.data import sha256

        out = {
            **common_inputs(project, prepared),
            **{f"eval.{k}": getattr(project.eval, k) for k in deciding(EvalSettings)},
            "data:test.jsonl": sha256(prepared.test),
        }
        for name in self.needs:  # the tuned adapter it grades
            out[f"stage:{name}"] = earlier[name].fingerprint
        return out

    def total(self, project: Project, prepared: Prepared) -> int:
        return prepared.n_test

    def execute(self, ctx: BuildContext, stop: int | None) -> tuple[dict[str, Any], bool]:
        from spill.jobs.rows.eval import EvalOptions, evaluate

        p = ctx.project
        adapter = None
        if self.adapter:
            tuned = self.upstream[0]
            adapter = ctx.local_folder(tuned.output(p.name), tuned.files)
        out = ctx.output(self.file)
        classes = ctx.prepared.labels if ctx.prepared.task == "classification" else ()
        opts = EvalOptions(max_new_tokens=p.eval.max_new_tokens, adapter=adapter, labels=classes)
        job = self.job_options(ctx, p.eval.batch, stop, "eval.batch")
        s = evaluate(p.model.name, ctx.work / self.reads, out, opts, job)
        complete = s.get("complete", True)
        result = {k: s[k] for k in (*self.KEYS, *self.PAIRS, "labels", "confusion") if k in s}
        if complete:
            ctx.publish(out)
            ctx.log_scores(self.name, result, p.tune.steps if self.adapter else 0)
        return result, complete

    def summarize(self, result: Mapping[str, Any]) -> str:
        if not result:
            return ""
        if result.get("accuracy") is None:
            return f"{result.get('rows', 0)} rows graded"
        text = f"accuracy {result['accuracy']:.3f} ({result['correct']}/{result['rows']})"
        if result.get("gold_logprob_per_token") is not None:
            text += f", logprob/token {result['gold_logprob_per_token']:.3f}"
        if result.get("preference_accuracy") is not None:
            text += f", prefers chosen {result['preference_accuracy']:.3f} of {result['pairs']}"
        return text

    def order(self, path: Path) -> tuple[list, Callable[[dict], dict]]:
        from spill.jobs.rows.eval import read_eval_rows

        return [r.id for r in read_eval_rows(path)], dict


class DistillStage(RowStage):
    """The teacher answers the training inputs; its file is the training data of tune."""

    # the prompts are already shaped by the project's prompt.* settings: no chat wrapping on top
    chat: ClassVar[bool] = False
    skipped: ClassVar[str] = "no teacher"

    def off(self, project: Project) -> str:
        return "" if project.teacher.name is not None else "no teacher (teacher.name is null)"

    def off_inputs(self) -> dict[str, Any]:
        return {"teacher.name": None}

    def inputs(
        self, project: Project, prepared: Prepared, earlier: Mapping[str, StageSpec]
    ) -> dict[str, Any]:
        from spill.project.data import sha256

        return {
            **stage_inputs("teacher", project.teacher),
            "seed": project.seed,
            "data:prompts.jsonl": sha256(prepared.prompts),
        }

    def total(self, project: Project, prepared: Prepared) -> int:
        return prepared.n_train

    def execute(self, ctx: BuildContext, stop: int | None) -> tuple[dict[str, Any], bool]:
        from spill.jobs.rows.distill import distill
        from spill.jobs.rows.generate import GenerateOptions

        p, t = ctx.project, ctx.project.teacher
        out = ctx.output(self.file)
        opts = GenerateOptions(
            max_new_tokens=t.max_new_tokens,
            temperature=t.temperature,
            seed=p.seed,
            chat=self.chat,
        )
        job = self.job_options(ctx, t.batch, stop, "teacher.batch")
        s = distill(t.name, ctx.work / self.reads, out, opts, job)
        complete = s.get("complete", True)
        if complete:
            ctx.publish(out)
        return {k: s[k] for k in ("rows", "truncated", "generated_tokens")}, complete

    def summarize(self, result: Mapping[str, Any]) -> str:
        if not result:
            return ""
        return f"{result['rows']} rows answered" + (
            f", {result['truncated']} cut at max_new_tokens" if result.get("truncated") else ""
        )

    def order(self, path: Path) -> tuple[list, Callable[[dict], dict]]:
        from spill.jobs.inputs import read_prompt_rows
        from spill.jobs.rows.distill import training_row

        rows = read_prompt_rows(path)
        prompts = {r.id: r for r in rows}
        return [r.id for r in rows], lambda r: training_row(
            prompts[r["id"]], r["output"], self.chat
        )
