"""``spill predict`` on a project (``predict_file``, ``predict_text``): its built model, prompt and
labels applied to new inputs. Everything comes from what the build recorded (``state.json``), not
from spill.yaml as it is now, so a prediction asks the tuned model exactly as the build trained and
graded it; an edit of spill.yaml since then changes nothing until ``spill build`` runs (a note says
so). A project that is not built, whose tune stage is not done, or whose published adapter is gone
or changed, is refused in one line that says to run ``spill build``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spill.console import note
from spill.errors import DataError, StoreError
from spill.ground.paths import STATE_DIR
from spill.jobs.inputs import PromptRow
from spill.jobs.rows.job import RowOptions
from spill.jobs.rows.predict import PredictOptions, PredictRow, predict, predict_one
from spill.models.quant import spec_of
from spill.project import sources
from spill.project.build import record
from spill.project.build.build import with_engine
from spill.project.build.stages import TUNE
from spill.project.bundle.installed import model_folder
from spill.project.config import Project, from_record
from spill.project.data import prompt_of, read_inputs
from spill.store.disk import local_copy
from spill.store.fs import join
from spill.store.location import Location, location


@dataclass(frozen=True)
class Built:
    """A built project as a prediction uses it."""

    project: Project
    labels: tuple[str, ...]  # the classification's label set; (): free text
    adapter: Path  # the published adapter, as a local folder
    where: str  # its location, for people


# What the build recorded: the config it composed (model, ``prompt.template``/``prompt.chat``,
# ``data.input``), the task and label set of its data, and the adapter its tune stage published
# under ``adapters/<name>/``.
def built(root: Path | str, state_root: Location | None = None) -> Built:
    """The recorded build of the project at ``root``; see the module doc for what is refused."""
    root = Path(root).resolve()
    if not (root / sources.FILE).is_file():
        from spill.project.config import compose

        compose(root)  # raises the one-line "no spill.yaml here" error
    where = state_root or location(root / STATE_DIR)
    doc = record.read(where)
    run = f"run `spill build {root}`"
    if doc is None:
        raise StoreError(f"{root.name} is not built yet ({where} holds no build); {run} first")
    rec = (doc.get("stages") or {}).get(TUNE.name) or {}
    if rec.get("status") != "done":
        progress = f"at step {rec['progress']} of {rec['total']}" if "total" in rec else "not run"
        raise StoreError(f"{root.name}'s tune stage is not done ({progress}); {run} to finish it")
    stage, name = TUNE, doc["project"]["name"]
    problem = stage.problem(where, name, rec.get("outputs"))
    if problem:
        raise StoreError(f"{root.name}'s tuned adapter: {problem}; {run} to publish it again")
    if sources.compose_key(root, tuple(doc.get("overrides") or ())) != doc["compose_key"]:
        note("spill.yaml changed since the build; predicting with the built adapter and its config")
    project = from_record(doc["config"], root, tuple(doc.get("overrides") or ()))
    labels = tuple(doc["data"]["labels"]) if doc["data"]["task"] == "classification" else ()
    rel = stage.output(name)
    # the adapter folder as a local folder (a copy of its files from a remote state)
    return Built(project, labels, local_copy(join(where, rel), stage.files), join(where, rel))


@dataclass(frozen=True, kw_only=True)
class Request:
    """How to predict: the command line's choices over the built project's own."""

    generate: bool = False  # free text even for a classification
    max_new_tokens: int | None = None  # None: eval.max_new_tokens, else teacher.max_new_tokens
    engine: tuple[str, ...] = ()  # engine.* overrides (--engine, --memory, ...)
    job: RowOptions = RowOptions(batch=None)  # batch, stop_after, the writer (--state)


def _options(b: Built, req: Request) -> PredictOptions:
    p = b.project
    new = req.max_new_tokens or p.eval.max_new_tokens or p.teacher.max_new_tokens
    return PredictOptions(
        labels=() if req.generate else b.labels,
        max_new_tokens=new,
        adapter=b.adapter,
        prompt={"template": p.prompt.template, "chat": p.prompt.chat},
    )


def _row(b: Built, rid: str | int, text: str) -> PredictRow:
    p = b.project
    shaped = prompt_of(text, b.labels, p.prompt.template, p.prompt.chat)
    return PredictRow(rid, PromptRow(rid, shaped.get("prompt"), shaped.get("messages")), text)


def _job(b: Built, req: Request) -> tuple[Project, RowOptions]:
    project = with_engine(b.project, req.engine)
    weights = model_folder(project.root, project.model.name)
    quantize = spec_of(project.model)  # the copy the build tuned on (model.quantize)
    job = dataclasses.replace(req.job, engine=project.engine, weights=weights, quantize=quantize)
    return project, job


def predict_file(
    root: Path | str,
    input_path: Path,
    out: Path,
    req: Request,
    build_state: Location | None = None,
) -> dict[str, Any]:
    """Answer every row of ``input_path`` (CSV or JSONL with the project's input column)."""
    b = built(root, build_state)
    project, job = _job(b, req)
    rows = [_row(b, rid, text) for rid, text in read_inputs(input_path, project.data.input)]
    summary = predict(project.model.name, input_path, rows, out, _options(b, req), job)
    return {"project": project.name, **summary, "adapter": b.where}


def predict_text(
    root: Path | str, text: str, req: Request, build_state: Location | None = None
) -> dict[str, Any]:
    """One input's answer (``--text``): its label and probability, or its generated text."""
    if not text.strip():
        raise DataError("--text is empty; give the input to predict on")
    b = built(root, build_state)
    project, job = _job(b, req)
    return predict_one(project.model.name, _row(b, "text", text), _options(b, req), job)
