"""The four stages of a build as ``StageSpec``s: what each one reads (pure, engine-free).

Inputs are keyed by the config path a user edits (``tune.lr``), ``data:<file>`` for a derived
file's hash and ``stage:<name>`` for the fingerprint of a stage whose output is read. What
cannot change a result stays out: ``tune.ckpt_every``, ``eval.batch``, ``teacher.batch``, the
engine group, comments.
"""

from __future__ import annotations

from dataclasses import asdict

from spill.project.config import Project
from spill.project.data import Prepared, sha256
from spill.project.plan import StageSpec
from spill.project.state import NEEDS


def specs(project: Project, prepared: Prepared) -> list[StageSpec]:
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
        "eval:base", {**graded, "data:test.jsonl": sha256(prepared.test)}, prepared.n_test
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
        "distill",
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
    tune = StageSpec("tune", tune_inputs, p.tune.steps, needs=NEEDS["tune"])

    tuned = {**graded, "data:test.jsonl": sha256(prepared.test), "stage:tune": tune.fingerprint}
    final = StageSpec("eval", tuned, prepared.n_test, needs=NEEDS["eval"])
    return [base, distill, tune, final]


def models(project: Project) -> dict[str, str | None]:
    """The model each stage loads (the teacher for distill; None when switched off)."""
    p = project
    return {
        "eval:base": p.model.name,
        "distill": p.teacher.name,
        "tune": p.model.name,
        "eval": p.model.name,
    }


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
