"""The stages of a build as objects: the vocabulary the planner, the executor and the tables use.

Each ``Stage`` says what the stage is: its name, its unit (step or row), its job folder under
``stages/``, the output it publishes, the stages whose output it reads, the model it loads, the
job it calls, how to summarize its result, how to probe how far its job got (through
``spill.store.checkpoint`` and ``spill.store.rows``) and how to publish its outputs again from its
committed state. Modules above iterate ``STAGES`` and ask the objects; none branches on a stage
name (in the spirit of DVC's ``dvc/stage``).

``specs`` turns a composed project into one ``StageSpec`` per stage: what each one reads in this
build (pure, engine-free). Inputs are keyed by the config path a user edits (``tune.lr``),
``data:<file>`` for a derived file's hash and ``stage:<name>`` for the fingerprint of a stage whose
output is read. What cannot change a result stays out: ``tune.ckpt_every``, ``eval.batch``,
``teacher.batch``, the engine group, comments.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from spill.project import outputs
from spill.store.fs import join

if TYPE_CHECKING:
    from spill.project.config import Project
    from spill.project.data import Prepared

PRODUCER_KEYS = ("engine", "numerics", "machine", "os", "hardware")


def _distinct(producers: list[Mapping[str, Any]]) -> list[dict]:
    """Producers (engine, numerics, machine, os, hardware), each once, in order."""
    out: list[dict] = []
    for p in producers if isinstance(producers, list) else []:  # a damaged file: none known
        p = {k: p.get(k) for k in PRODUCER_KEYS} if isinstance(p, Mapping) else {}
        if p not in out:
            out.append(p)
    return out


@dataclass(frozen=True, kw_only=True)
class Stage:
    """One stage of a build; subclasses say how its job's state and outputs look."""

    name: str
    folder: str  # its job state: stages/<folder>/ under the state location
    job: str  # the job it calls: eval, distill or tune
    needs: tuple[str, ...] = ()  # earlier stages whose output it reads
    model_key: str = "model.name"  # the setting naming the model it loads
    unit: ClassVar[str] = ""  # what its progress counts
    marker: ClassVar[str] = ""  # the file inside its output that stands for it in old records

    def uri(self, root: str) -> str:
        return join(root, "stages", self.folder)

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


@dataclass(frozen=True, kw_only=True)
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

        found = newest_commit(self.uri(root))
        if found is None:
            return 0, []
        step, state = found
        return step, _distinct(state.get("producers") or [])

    def _source(self, done: int) -> str:
        return f"{self.name} step {done} checkpoint"

    def publish(self, root: str, project: str) -> None:
        outputs.copy_tree(join(self.uri(root), self.exported), join(root, self.output(project)))

    def restore(self, root, project, inputs, recorded) -> None:
        where = self.uri(root)
        outputs.restore_adapter(
            where, join(where, self.exported), root, self.output(project), recorded
        )


@dataclass(frozen=True, kw_only=True)
class RowStage(Stage):
    """A row job; progress is the rows of its committed segments."""

    file: str  # what it publishes under files/
    reads: str  # the derived input it reads, which gives the order of its rows
    unit: ClassVar[str] = "row"

    def output(self, project: str) -> str:
        return f"files/{self.file}"

    def probe(self, root: str) -> tuple[int, list[dict]]:
        from spill.store.rows import commit_markers

        markers = commit_markers(self.uri(root))
        rows = sum(int(m.get("count", 0)) for m in markers)
        return rows, _distinct([m.get("producer") or {} for m in markers])

    def _source(self, done: int) -> str:
        return f"{done} committed rows"

    def restore(self, root, project, inputs, recorded) -> None:
        ids, shape = self.order(inputs / self.reads)
        outputs.restore_rows(self.uri(root), join(root, self.output(project)), ids, shape)

    def order(self, path: Path) -> tuple[list, Callable[[dict], dict]]:
        """The row ids of its input in order, and how a committed row becomes a line of its file."""
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class EvalStage(RowStage):
    """Grades a model on the test rows: the base model, or the tuned one (``adapter``)."""

    adapter: bool = False

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


@dataclass(frozen=True, kw_only=True)
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


def fingerprint(inputs: Mapping[str, Any]) -> str:
    text = json.dumps(inputs, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class StageSpec:
    """What a stage is in this build: its inputs and size."""

    name: str
    inputs: Mapping[str, Any]  # key path -> value: everything that decides the stage's result
    total: int  # steps or rows
    enabled: bool = True
    why_off: str = ""  # reason when not enabled

    @property
    def stage(self) -> Stage:
        return get(self.name)

    @property
    def needs(self) -> tuple[str, ...]:
        return self.stage.needs

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.inputs)


def specs(project: Project, prepared: Prepared) -> list[StageSpec]:
    """One spec per stage of ``STAGES``, in order."""
    from spill.project.data import sha256

    p = project
    common = {
        "model.name": p.model.name,
        "seed": p.seed,
        "data.input": p.data.input,
        "data.output": p.data.output,
        "data.task": prepared.task,
        "data.test_fraction": p.data.test_fraction,
        "prompt.template": p.prompt.template,
        "prompt.chat": p.prompt.chat,
    }
    graded = {**common, "eval.max_new_tokens": p.eval.max_new_tokens}
    base = StageSpec(
        EVAL_BASE.name, {**graded, "data:test.jsonl": sha256(prepared.test)}, prepared.n_test
    )

    teacher = p.teacher.name
    distill_inputs = {
        "teacher.name": teacher,
        "teacher.max_new_tokens": p.teacher.max_new_tokens,
        "teacher.temperature": p.teacher.temperature,
        "seed": p.seed,
        "data:prompts.jsonl": sha256(prepared.prompts),
    }
    distill = StageSpec(
        DISTILL.name,
        distill_inputs if teacher else {"teacher.name": None},
        prepared.n_train,
        enabled=teacher is not None,
        why_off="no teacher (teacher.name is null)",
    )

    tune_values = {f"tune.{k}": v for k, v in asdict(p.tune).items() if k != "ckpt_every"}
    tune_inputs = {**common, **tune_values}
    if teacher:
        tune_inputs["stage:distill"] = distill.fingerprint
    else:
        tune_inputs["data:train.jsonl"] = sha256(prepared.train)
    tune = StageSpec(TUNE.name, tune_inputs, p.tune.steps)

    tuned = {**graded, "data:test.jsonl": sha256(prepared.test), "stage:tune": tune.fingerprint}
    final = StageSpec(EVAL.name, tuned, prepared.n_test)
    return [base, distill, tune, final]


def check_model_name(name: str, key: str) -> None:
    """Refuse a model name that can name nothing, without loading or fetching anything.

    The same order as ``spill.models.resolve.resolve_model``: a URI is staged (checked when it
    is); ``tiny:`` must parse; a local folder must exist (relative to here, as the jobs read it);
    an alias must be known; a hub id is accepted as spelled (the hub cannot be asked offline).
    """
    from pathlib import Path

    from spill.errors import ModelError, ModelNotFound
    from spill.models.names import (
        ALIASES,
        looks_like_alias,
        looks_like_hub_id,
        parse_tiny,
        resolve_alias,
    )

    text = name.strip()
    if not text:
        raise ModelNotFound(f"{key} is empty; name an alias, a hub id or a local model folder")
    if "://" in text:
        return
    try:
        if parse_tiny(text) is not None:
            return
        path = Path(text).expanduser()
        if path.is_dir():
            return
        if path.is_file():
            raise ModelError(
                f"{key}: {text} is a file, not a model folder; give an HF-layout folder"
            )
        if text.startswith(("/", ".", "~")) or "\\" in text or text.count("/") > 1:
            raise ModelNotFound(
                f"{key}: {text}: no such folder; give an HF-layout model folder, an alias or a hub id"
            )
        if looks_like_alias(text):
            resolve_alias(text)
            return
    except ModelError as e:
        message = str(e)
        raise type(e)(message if message.startswith(key) else f"{key}: {message}") from None
    if not looks_like_hub_id(text):
        raise ModelNotFound(
            f"{key}: no model named {text!r}: not a folder here, an alias ({', '.join(ALIASES)}) "
            "or a hub id (org/name)"
        )
