"""What a job logs to its trackers: ``TrackSpec``, made by the CLI (``--log``) or the build's tune
stage (``tune.log``), and the checks that refuse a tracker before any model loads.

A spec names no default of its own that a setting has: the kinds come from ``tune.log`` (default
in conf/tune/default.yaml). ``experiment``/``run``/``key`` left None are filled in by the job
from its name and state: a bare ``spill tune`` is the experiment and run ``--name``, keyed by its
state's URI, so a resumed run (here or on any machine with the same ``--state``) finds the run
it logged before.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spill.errors import SpillError
from spill.ground.paths import spill_home
from spill.settings import TRACKERS
from spill.store.location import Location

EXTRA = {"tensorboard": "tensorboard", "mlflow": "mlflow"}  # kind -> the package it imports


class TrackerMissing(SpillError):
    """A tracker asked for whose package is not installed."""


@dataclass(frozen=True)
class TrackSpec:
    """The trackers of one run: ``kinds`` (``tune.log``); ``experiment`` and ``run`` its MLflow
    names; ``params`` the run's settings (flat: ``tune.lr``); ``tags`` extra MLflow tags (a sweep
    job's overrides); ``logdir`` the TensorBoard folder (None: ``logdir_for`` the state);
    ``key`` what identifies the run across resumes (None: the state's URI and the job's name)."""

    kinds: tuple[str, ...]
    experiment: str | None = None
    run: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    logdir: str | None = None
    key: str | None = None

    def check(self) -> None:
        """Refuse an unknown tracker or one whose package is missing, in one line each."""
        check(self.kinds)


def check(kinds: tuple[str, ...] | list[str]) -> None:
    for kind in kinds:
        if kind not in TRACKERS:
            raise SpillError(
                f"{kind!r} is not a tracker spill logs to: use {' or '.join(TRACKERS)}"
            )
        try:
            importlib.import_module(EXTRA[kind])
        except ImportError:
            raise TrackerMissing(
                f"logging to {kind} needs its package: pip install 'streamweights[{kind}]' "
                f"(or drop {kind} from --log / tune.log)"
            ) from None


def logdir_for(state: Location, name: str) -> tuple[str, bool]:
    """A bare job's TensorBoard folder: ``<state>/tensorboard`` when the state is local, else
    ``$SPILL_HOME/tensorboard/<name>`` on this machine (True: it is not beside the state)."""
    if (beside := state.on_disk("tensorboard")) is not None:
        return str(Path(beside)), False
    return str(spill_home() / "tensorboard" / name), True


def run_key(text: str) -> str:
    """The ``spill.key`` tag: a digest of what identifies the run (no quoting in a filter)."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def flat(prefix: str, values: Any) -> dict[str, Any]:
    """A settings dataclass (or dict) as flat params: ``tune.lr``, ``tune.log`` as ``a,b``."""
    items = dataclasses.asdict(values) if dataclasses.is_dataclass(values) else dict(values)
    out = {}
    for k, v in items.items():
        out[f"{prefix}.{k}"] = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else v
    return out
