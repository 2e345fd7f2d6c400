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
    tune = StageSpec("tune", tune_inputs, p.tune.steps, needs=("distill",))

    tuned = {**graded, "data:test.jsonl": sha256(prepared.test), "stage:tune": tune.fingerprint}
    final = StageSpec("eval", tuned, prepared.n_test, needs=("tune",))
    return [base, distill, tune, final]
