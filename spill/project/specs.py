"""What each stage reads in one build: ``specs(project, prepared)`` -> one ``StageSpec`` each.

Pure and engine-free. Inputs are keyed by the config path a user edits (``tune.lr``),
``data:<file>`` for a derived file's hash and ``stage:<name>`` for the fingerprint of a stage
whose output is read. What cannot change a result stays out: ``tune.ckpt_every``,
``eval.batch``, ``teacher.batch``, the engine group, comments.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from spill.project.stages import DISTILL, EVAL, EVAL_BASE, TUNE, Stage, get

if TYPE_CHECKING:
    from spill.project.config import Project
    from spill.project.data import Prepared


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

    same = ("ckpt_every", "activations")  # neither changes a bit of the result
    tune_values = {f"tune.{k}": v for k, v in asdict(p.tune).items() if k not in same}
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
