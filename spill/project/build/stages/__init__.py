"""The stages of a build as objects: the vocabulary the planner, the executor and the tables use.

Each stage (``base.Stage``) says what decides its result in one build, the job it runs, what it
publishes, the stages whose output it reads, the model it loads, and how its committed state is
probed and published again. The planner, the executor, status and the tables iterate ``STAGES``
and ask the objects; none of them branches on a stage's name, so a new stage is one class and
one entry below (in the spirit of DVC's ``dvc/stage``).
"""

from __future__ import annotations

from spill.project.build.stages.base import PRODUCER_KEYS, Stage, distinct
from spill.project.build.stages.export import ExportStage
from spill.project.build.stages.rows import DistillStage, EvalStage, RowStage
from spill.project.build.stages.tune import TuneStage

__all__ = [
    "ALIASES",
    "DISTILL",
    "EVAL",
    "EVAL_BASE",
    "EXPORT",
    "NAMES",
    "PRODUCER_KEYS",
    "STAGES",
    "TUNE",
    "DistillStage",
    "EvalStage",
    "ExportStage",
    "RowStage",
    "Stage",
    "TuneStage",
    "distinct",
    "finished",
    "get",
]

EVAL_BASE = EvalStage(
    name="eval:base", folder="eval-base", file="eval-base.jsonl", reads="test.jsonl"
)
DISTILL = DistillStage(
    name="distill",
    folder="distill",
    model_key="teacher.name",
    file="teacher.jsonl",
    reads="prompts.jsonl",
)
TUNE = TuneStage(name="tune", folder="tune", upstream=(DISTILL,))
EVAL = EvalStage(
    name="eval",
    folder="eval",
    file="eval.jsonl",
    reads="test.jsonl",
    adapter=True,
    upstream=(TUNE,),
)
EXPORT = ExportStage(name="export", folder="export", upstream=(TUNE,))
STAGES: tuple[Stage, ...] = (EVAL_BASE, DISTILL, TUNE, EVAL, EXPORT)
NAMES = tuple(s.name for s in STAGES)
ALIASES = {"train": "tune"}
_BY_NAME = {s.name: s for s in STAGES}


def finished(recs: dict) -> bool:
    """Whether a state's stage records (``state.json``'s ``stages``) say every stage is done or
    skipped."""
    return all((recs.get(s.name) or {}).get("status") in ("done", "skipped") for s in STAGES)


def get(name: str) -> Stage:
    """The stage called ``name`` (``KeyError`` for none)."""
    return _BY_NAME[name]
