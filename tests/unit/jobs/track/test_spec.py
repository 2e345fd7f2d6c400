"""``spill.jobs.track.spec`` and the ``--log`` flag: trackers named, checked and placed."""

from __future__ import annotations

import argparse
import sys

import pytest

from spill.cli.options import trackers
from spill.errors import SpillError
from spill.jobs.track.spec import TrackerMissing, TrackSpec, check, flat, logdir_for, run_key
from spill.settings import TuneSettings
from spill.store.location import location


def test_the_log_flag_is_a_comma_separated_list_of_known_trackers():
    assert trackers("tensorboard,mlflow") == ("tensorboard", "mlflow")
    assert trackers(" mlflow , mlflow ") == ("mlflow",) and trackers("") == ()
    with pytest.raises(argparse.ArgumentTypeError, match="'wandb' is not a tracker"):
        trackers("mlflow,wandb")


def test_an_unknown_tracker_and_a_missing_package_are_one_line(monkeypatch):
    with pytest.raises(SpillError, match="'wandb' is not a tracker spill logs to"):
        check(["wandb"])
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    with pytest.raises(TrackerMissing) as e:
        TrackSpec(kinds=("mlflow",)).check()
    assert "pip install 'streamweights[mlflow]'" in str(e.value) and "\n" not in str(e.value)


def test_a_bare_runs_event_files_sit_beside_a_local_state(tmp_path, monkeypatch):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    beside = (str(tmp_path / "st" / "tensorboard"), False)
    assert logdir_for(location(str(tmp_path / "st")), "job") == beside
    assert logdir_for(location("s3://bucket/st"), "job") == (
        str(tmp_path / "home" / "tensorboard" / "job"),
        True,
    )


def test_params_are_flat_and_the_key_quotes_nothing():
    t = TuneSettings(**{**_tune(), "log": ["mlflow"]})
    assert t.log == ("mlflow",) and hash(t)  # a YAML list, frozen
    params = flat("tune", t)
    assert params["tune.lr"] == t.lr and params["tune.log"] == "mlflow"
    key = run_key("s3://b/it's#job")
    assert len(key) == 32 and key.isalnum()


def _tune() -> dict:
    from spill.conf import defaults

    return defaults("tune")
