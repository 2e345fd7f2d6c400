"""A build's trackers (``tune.log``): one run per build, the tune stage's steps and the eval
stages' scores in it; the experiment is the project's name.

The run is named by the build's overrides (a sweep's jobs are sibling runs) and keyed by the
tune stage's state and inputs, so a resumed build logs into the run it started. TensorBoard
writes under ``<project>/.spill/tensorboard/<run>/``. The executor calls ``prepare``; stages
see the result through ``BuildContext`` (``ctx.track``, ``ctx.log_scores``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from spill.ground.paths import STATE_DIR
from spill.jobs.track import TrackSpec, check, flat
from spill.project.build.context import BuildContext
from spill.project.build.stages import TUNE
from spill.project.build.stages.spec import StageSpec
from spill.project.config import Project


def run_name(overrides: list[str] | tuple[str, ...]) -> str:
    """A sweep job's name (its state folder): its overrides, ``/`` and odd characters made safe."""
    text = ",".join(overrides) or "default"
    return re.sub(r"[^A-Za-z0-9._=,+@:-]+", "_", text)


def prepare(ctx: BuildContext, specs: Mapping[str, StageSpec]) -> None:
    """Before any stage runs: refuse a tracker whose package is missing, and give the build's
    run to the context (``ctx.track``), keyed by the tune stage's state and fingerprint."""
    if not ctx.project.tune.log:
        return
    check(ctx.project.tune.log)
    tuned = specs.get(TUNE.name)
    ctx.track = spec(ctx.project, f"{TUNE.uri(ctx.root)}#{tuned.fingerprint if tuned else ''}")


def spec(p: Project, key: str) -> TrackSpec | None:
    """The build of ``p`` as a ``TrackSpec`` (None: ``tune.log`` is empty)."""
    if not p.tune.log:
        return None
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
    return TrackSpec(
        kinds=p.tune.log,
        experiment=p.name,
        run=run,
        params=params,
        tags={"spill.project": p.name, "spill.overrides": " ".join(p.overrides)},
        logdir=str(p.root / STATE_DIR / "tensorboard" / run),
        key=key,
    )
