"""The stages of a build as objects: the vocabulary the planner, the executor and the tables use.

Each ``Stage`` says what the stage is: its name, its unit (step or row), its job folder under
``stages/``, the output it publishes, the stages whose output it reads, the model it loads, the
job it calls, how to summarize its result, how to probe how far its job got (through
``spill.store.checkpoint`` and ``spill.store.rows``) and how to publish its outputs again from its
committed state. Modules above iterate ``STAGES`` and ask the objects; none branches on a stage
name (in the spirit of DVC's ``dvc/stage``).

The stages are plain classes, not dataclasses: a finished ``spill build`` imports this module
to check each stage's outputs, and that answer should not pay for ``dataclasses`` (what each
stage reads in one build, ``StageSpec``, lives in ``spill.project.specs``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from spill.project import outputs
from spill.store.fs import join

if TYPE_CHECKING:
    from spill.control.control import Run
    from spill.control.place import Place
    from spill.project.config import Project

PRODUCER_KEYS = ("engine", "numerics", "machine", "os", "hardware")


def _distinct(producers: list[Mapping[str, Any]]) -> list[dict]:
    """Producers (engine, numerics, machine, os, hardware), each once, in order."""
    out: list[dict] = []
    for p in producers if isinstance(producers, list) else []:  # a damaged file: none known
        p = {k: p.get(k) for k in PRODUCER_KEYS} if isinstance(p, Mapping) else {}
        if p not in out:
            out.append(p)
    return out


class Stage:
    """One stage of a build; subclasses say how its job's state and outputs look."""

    unit: ClassVar[str] = ""  # what its progress counts
    marker: ClassVar[str] = ""  # the file inside its output that stands for it in old records

    def __init__(
        self,
        *,
        name: str,
        folder: str,  # its job state: stages/<folder>/ under the state location
        job: str,  # the job it calls: eval, distill or tune
        needs: tuple[str, ...] = (),  # earlier stages whose output it reads
        model_key: str = "model.name",  # the setting naming the model it loads
    ) -> None:
        self.name, self.folder, self.job = name, folder, job
        self.needs, self.model_key = needs, model_key

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def uri(self, root: str) -> str:
        return join(root, "stages", self.folder)

    def place(self, root: str, run: Run | None = None) -> Place:
        """Its job's part of the build's run (read-only without ``run``)."""
        from spill.control.place import Place

        return Place(root, f"stages/{self.folder}", run)

    def output(self, project: str) -> str:
        """What it publishes, relative to the state location."""
        raise NotImplementedError

    def model(self, project: Project) -> str | None:
        """The model it loads (None when switched off)."""
        value: Any = project
        for part in self.model_key.split("."):
            value = getattr(value, part)
        return value

    def summarize(self, result: Mapping[str, Any]) -> str:
        """Its result in a few words (the table and the plan's ``done`` reasons)."""
        raise NotImplementedError

    def count_name(self) -> str:
        """What its total counts, for a --stop-after past the end."""
        return f"{self.name}'s rows"

    def probe(self, root: str) -> tuple[int, list[dict]]:
        """(steps or rows committed, distinct producers) from its job state; light: no hashing."""
        raise NotImplementedError

    def source(self, root: str, total: int) -> str:
        """The committed state its outputs can be restored from, or ``""``."""
        done = self.probe(root)[0]
        return self._source(done) if done >= total else ""

    def _source(self, done: int) -> str:
        raise NotImplementedError

    def problem(self, root: str, project: str, recorded: Mapping[str, Any] | None) -> str:
        """What is wrong with its recorded outputs (``adapters/toy missing``), or ``""``."""
        return outputs.problem(root, self.output(project), recorded, self.marker)

    def record(self, root: str, project: str) -> dict[str, dict[str, Any]]:
        """What ``state.json`` keeps about its published outputs."""
        return outputs.record(root, self.output(project))

    def publish(self, root: str, project: str) -> None:
        """After its job finished: publish what the job left in its folder (nothing by default)."""

    def restore(
        self, root: str, project: str, inputs: Path, recorded: Mapping[str, Any] | None
    ) -> None:
        """Publish its outputs again from its committed state; ``inputs``: the build's derived
        input files (``test.jsonl``...)."""
        raise NotImplementedError


class TuneStage(Stage):
    """Trains the adapter; progress is the newest committed checkpoint's step."""

    unit: ClassVar[str] = "step"
    marker: ClassVar[str] = "params.safetensors"
    exported: ClassVar[str] = "adapter"  # where the tune job exports, inside its folder

    def output(self, project: str) -> str:
        return f"adapters/{project}"

    def summarize(self, result: Mapping[str, Any]) -> str:
        if not result:
            return ""
        loss = result.get("loss")
        return f"{result['step']} of {result['steps']} steps" + (
            f", loss {loss:.4f}" if loss is not None else ""
        )

    def count_name(self) -> str:
        return f"{self.name}.steps"

    def probe(self, root: str) -> tuple[int, list[dict]]:
        from spill.store.checkpoint import newest_commit

        found = newest_commit(self.place(root))
        if found is None:
            return 0, []
        step, state = found
        return step, _distinct(state.get("producers") or [])

    def _source(self, done: int) -> str:
        return f"{self.name} step {done} checkpoint"

    def publish(self, root: str, project: str) -> None:
        outputs.copy_tree(join(self.uri(root), self.exported), join(root, self.output(project)))

    def restore(self, root, project, inputs, recorded) -> None:
        outputs.restore_adapter(
            self.place(root),
            join(self.uri(root), self.exported),
            root,
            self.output(project),
            recorded,
        )


class RowStage(Stage):
    """A row job; progress is the rows of its committed segments."""

    unit: ClassVar[str] = "row"

    def __init__(self, *, file: str, reads: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.file = file  # what it publishes under files/
        self.reads = reads  # the derived input it reads, which gives the order of its rows

    def output(self, project: str) -> str:
        return f"files/{self.file}"

    def probe(self, root: str) -> tuple[int, list[dict]]:
        from spill.store.rows import commit_markers

        markers = commit_markers(self.place(root))
        rows = sum(int(m.get("count", 0)) for m in markers)
        return rows, _distinct([m.get("producer") or {} for m in markers])

    def _source(self, done: int) -> str:
        return f"{done} committed rows"

    def restore(self, root, project, inputs, recorded) -> None:
        ids, shape = self.order(inputs / self.reads)
        outputs.restore_rows(self.place(root), join(root, self.output(project)), ids, shape)

    def order(self, path: Path) -> tuple[list, Callable[[dict], dict]]:
        """The row ids of its input in order, and how a committed row becomes a line of its file."""
        raise NotImplementedError


class EvalStage(RowStage):
    """Grades a model on the test rows: the base model, or the tuned one (``adapter``)."""

    def __init__(self, *, adapter: bool = False, **kw: Any) -> None:
        super().__init__(**kw)
        self.adapter = adapter

    def summarize(self, result: Mapping[str, Any]) -> str:
        if not result:
            return ""
        if result.get("accuracy") is None:
            return f"{result.get('rows', 0)} rows graded"
        text = f"accuracy {result['accuracy']:.3f} ({result['correct']}/{result['rows']})"
        if result.get("gold_logprob_per_token") is not None:
            text += f", logprob/token {result['gold_logprob_per_token']:.3f}"
        return text

    def order(self, path: Path) -> tuple[list, Callable[[dict], dict]]:
        from spill.jobs.eval import read_eval_rows

        return [r.id for r in read_eval_rows(path)], dict


class DistillStage(RowStage):
    """The teacher answers the training inputs; its file is the training data of tune."""

    # the prompts are already shaped by the project's prompt.* settings: no chat wrapping on top
    chat: ClassVar[bool] = False

    def summarize(self, result: Mapping[str, Any]) -> str:
        if not result:
            return ""
        return f"{result['rows']} rows answered" + (
            f", {result['truncated']} cut at max_new_tokens" if result.get("truncated") else ""
        )

    def order(self, path: Path) -> tuple[list, Callable[[dict], dict]]:
        from spill.jobs.distill import training_row
        from spill.jobs.inputs import read_prompt_rows

        rows = read_prompt_rows(path)
        prompts = {r.id: r for r in rows}
        return [r.id for r in rows], lambda r: training_row(
            prompts[r["id"]], r["output"], self.chat
        )


EVAL_BASE = EvalStage(
    name="eval:base", folder="eval-base", job="eval", file="eval-base.jsonl", reads="test.jsonl"
)
DISTILL = DistillStage(
    name="distill",
    folder="distill",
    job="distill",
    model_key="teacher.name",
    file="teacher.jsonl",
    reads="prompts.jsonl",
)
TUNE = TuneStage(name="tune", folder="tune", job="tune", needs=("distill",))
EVAL = EvalStage(
    name="eval",
    folder="eval",
    job="eval",
    file="eval.jsonl",
    reads="test.jsonl",
    adapter=True,
    needs=("tune",),
)
STAGES: tuple[Stage, ...] = (EVAL_BASE, DISTILL, TUNE, EVAL)
NAMES = tuple(s.name for s in STAGES)
ALIASES = {"train": "tune"}
_BY_NAME = {s.name: s for s in STAGES}


def get(name: str) -> Stage:
    """The stage called ``name`` (``KeyError`` for none)."""
    return _BY_NAME[name]
