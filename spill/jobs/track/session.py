"""The tune job's trackers, on rank 0 only: made around the run (``session``), opened once the
job knows its producer (``Session.start``, after the checkpoint it continues from is loaded),
fed each commit (``Session.committed``) and closed whatever ends the run.

A spec's unset names come from the job: the experiment and the run are its ``--name``, the key
its state's URI and name, the TensorBoard folder ``<state>/tensorboard`` on a local state (else
``$SPILL_HOME/tensorboard/<name>``, which the pre-run line says). The producer (engine,
machine, OS, numerics) of the leg that opens is set as MLflow tags.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from spill.console import note
from spill.ground.paths import spill_home
from spill.jobs.group import current
from spill.jobs.preempt import Preempted
from spill.jobs.track.spec import TrackSpec, logdir_for
from spill.jobs.track.tracking import Tracking, open_tracking, where
from spill.store.location import Location

PRODUCER_TAGS = ("engine", "machine", "os", "numerics", "hardware")
STOPPING_WITHIN = 5.0  # seconds a stopped run waits for its trackers (its deadline is 30 s)


class Session:
    """A run's trackers, or nothing (no spec): every call then does nothing."""

    def __init__(self, spec: TrackSpec | None, root: Location, name: str) -> None:
        self.spec, self.root, self.name = spec, root, name
        self.tracking = Tracking([])

    def start(self, producer: dict[str, Any], tune: Any, state: dict | None) -> None:
        """Open the trackers and back-fill what ``state`` (the checkpoint continued from, None
        for a fresh run) committed that they do not hold yet."""
        s = self.spec
        if s is None or not s.kinds:
            return
        logdir, aside = (s.logdir, False) if s.logdir else logdir_for(self.root, self.name)
        tags = {f"spill.{k}": str(producer[k]) for k in PRODUCER_TAGS if producer.get(k)}
        self.tracking = open_tracking(
            s.kinds,
            key=s.key or f"{self.root}#{self.name}",
            experiment=s.experiment or self.name,
            run_name=s.run or self.name,
            logdir=logdir,
            params=s.params,
            tags={**s.tags, **tags},
            tune=tune,
        )
        aside = aside and "tensorboard" in s.kinds
        note(
            f"logging to {where(self.tracking)}"
            + (
                " (the state is not local: TensorBoard's files are on this machine)"
                if aside
                else ""
            )
        )
        if state is not None:
            self.tracking.committed(state)

    def committed(self, state: dict, rates: dict[int, float]) -> None:
        self.tracking.committed(state, rates)

    def metrics(self, values: dict[str, float], step: int = 0) -> None:
        self.tracking.metrics(values, step)


@contextmanager
def session(spec: TrackSpec | None, root: Location, name: str, steps: int) -> Iterator[Session]:
    """A ``Session`` closed FINISHED when the last step is committed, KILLED when the run stops
    before it (``--stop-after``, preempted: waiting at most ``STOPPING_WITHIN`` for the
    trackers), FAILED on an error."""
    s = Session(spec, root, name)
    try:
        yield s
    except (Preempted, KeyboardInterrupt):  # a stop has a deadline: the trackers get a part
        s.tracking.close("KILLED", within=STOPPING_WITHIN)
        raise
    except BaseException:
        s.tracking.close("FAILED")
        raise
    s.tracking.close("FINISHED" if s.tracking.step >= steps else "KILLED")


OFF = Session(None, "", "")  # a job without trackers (the ranks other than 0)


def log_scores(
    spec: TrackSpec, values: dict[str, Any], step: int = 0, status: str | None = "FINISHED"
) -> None:
    """A job's results (an eval's scores) as metrics of the spec's run at ``step``, each once;
    ``status``: the MLflow run's afterwards (None: as it was). Rank 0 only (``--procs``)."""
    assert spec.key and spec.experiment and spec.run, "a result run names itself"
    if not current().leader:
        return
    logdir = spec.logdir or str(spill_home() / "tensorboard" / spec.run)
    tracking = open_tracking(
        spec.kinds,
        key=spec.key,
        experiment=spec.experiment,
        run_name=spec.run,
        logdir=logdir,
        params=spec.params,
        tags=spec.tags,
    )
    try:
        tracking.metrics(values, step)
    finally:
        tracking.close(status)
