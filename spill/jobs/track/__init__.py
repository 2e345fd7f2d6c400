"""Trackers: a run's metrics in TensorBoard event files and MLflow runs (``tune.log``, ``--log``).

Engine-free and light: importing this package imports neither tensorboard nor mlflow (each is
an optional extra, ``streamweights[tensorboard]`` / ``[mlflow]``, imported when opened).
``spec`` says what a job logs and refuses a missing package before a model loads; ``tracking``
logs committed steps exactly once across resumes; ``session`` is the tune job's rank-0 wrapper;
``tensorboard_files`` and ``mlflow_runs`` are the two trackers. docs/watching.md has the layout.
"""

from spill.jobs.track.session import OFF, Session, log_scores, session
from spill.jobs.track.spec import TrackSpec, check, flat, logdir_for
from spill.jobs.track.tracking import Tracking, open_tracking

__all__ = [
    "OFF",
    "Session",
    "TrackSpec",
    "Tracking",
    "check",
    "flat",
    "log_scores",
    "logdir_for",
    "open_tracking",
    "session",
]
