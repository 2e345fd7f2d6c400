"""A build's trackers (``tune.log``): one run per build, the tune stage's steps and the eval
stages' scores in it.

The experiment is the project's name; the run is the build: its overrides (a sweep job's, made
safe as ``spill.project.sweep.run_name`` makes its state folder) or the project's name when it
has none, so the jobs of a sweep are sibling runs of one experiment with their overrides as
params. The run is keyed by the tune stage's state and its inputs' fingerprint, so a resumed
build logs into the run it started, and a build whose tune inputs changed starts another.
TensorBoard's files go to ``<project>/.spill/tensorboard/<run>/`` whatever the state location:
``tensorboard --logdir <project>/.spill/tensorboard`` shows every run of the project.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spill.paths import STATE_DIR

if TYPE_CHECKING:
    from spill.jobs.track import TrackSpec
    from spill.project.context import BuildContext


def prepare(ctx: BuildContext, specs) -> None:
    """Before any stage runs: refuse a tracker whose package is missing, and note the tune
    stage's fingerprint, which keys the run (``specs``: the build's ``StageSpec``s)."""
    if not ctx.project.tune.log:
        return
    from spill.jobs.track import check

    check(ctx.project.tune.log)
    ctx.run_key = next((s.fingerprint for s in specs if s.name == "tune"), "")


def spec(ctx: BuildContext) -> TrackSpec | None:
    """The build's run as a ``TrackSpec`` (None: ``tune.log`` is empty)."""
    p = ctx.project
    if not p.tune.log:
        return None
    from spill.jobs.track import TrackSpec, flat
    from spill.project.stages import get
    from spill.project.sweep import run_name

    run = run_name(p.overrides) if p.overrides else p.name
    params: dict[str, Any] = {
        **flat("tune", p.tune),
        **flat("model", p.model),
        "teacher.name": p.teacher.name,
        "data.file": p.data.file,
        "seed": p.seed,
    }
    if p.overrides:
        params["overrides"] = " ".join(p.overrides)
    tags = {"spill.project": p.name, "spill.overrides": " ".join(p.overrides)}
    return TrackSpec(
        kinds=p.tune.log,
        experiment=p.name,
        run=run,
        params=params,
        tags=tags,
        logdir=str(p.root / STATE_DIR / "tensorboard" / run),
        key=f"{get('tune').uri(ctx.root)}#{ctx.run_key}",
    )


def log_scores(ctx: BuildContext, stage: str, scores: dict[str, Any], step: int) -> None:
    """An eval stage's scores as the run's metrics ``<stage>/<score>`` at ``step`` (the tuned
    adapter's step, 0 for the base model); rank 0 only, each once."""
    s = spec(ctx)
    if s is None:
        return
    from spill.jobs.track import log_scores as log
    from spill.jobs.track.tracking import metric_name

    values = {f"{metric_name(stage)}/{k}": v for k, v in scores.items()}
    log(s, values, step, "FINISHED" if step else None)  # eval:base: the tune follows
