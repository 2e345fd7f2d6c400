"""``spill.jobs.track.session``: the tune job's trackers, opened once the producer is known and
closed with the status the run ended in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("tensorboard", reason="tensorboard is in the test extra")

from spill.jobs.preempt import Preempted  # noqa: E402
from spill.jobs.track import TrackSpec, session  # noqa: E402
from spill.jobs.track.tensorboard_files import logged  # noqa: E402
from spill.store.location import location  # noqa: E402

TUNE = SimpleNamespace(lr=0.01, warmup=0, steps=4)
ME = {"engine": "torch", "machine": "m", "os": "Linux", "numerics": "float32"}


def test_a_remote_states_event_files_are_on_this_machine_and_the_line_says_so(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("SPILL_HOME", str(tmp_path / "home"))
    with session(TrackSpec(kinds=("tensorboard",)), location("s3://bucket/job"), "job", 4) as logs:
        logs.start(ME, TUNE, {"step": 2, "losses": [2.0, 1.0]})  # back-filled on open
    err = capsys.readouterr().err
    where = tmp_path / "home" / "tensorboard" / "job"
    assert f"logging to tensorboard {where} (the state is not local" in err
    assert logged(where) == {"train/loss": 2, "train/lr": 2}


def test_statuses_follow_how_the_run_ended(tmp_path):
    closed = []

    class Fake:
        name, last = "fake", {}

        def write(self, points):
            pass

        def close(self, status):
            closed.append(status)

    def run(step: int, error: BaseException | None = None) -> None:
        with session(TrackSpec(kinds=("tensorboard",)), location(str(tmp_path)), "job", 4) as logs:
            logs.tracking.backends = [Fake()]
            logs.tracking.tune = TUNE
            logs.committed({"step": step, "losses": [1.0] * step}, {})
            if error is not None:
                raise error

    run(4)
    run(2)
    with pytest.raises(Preempted):
        run(3, Preempted("stopped"))
    with pytest.raises(RuntimeError):
        run(3, RuntimeError("boom"))
    assert closed == ["FINISHED", "KILLED", "KILLED", "FAILED"]


def test_no_spec_no_trackers(tmp_path):
    with session(None, location(str(tmp_path)), "job", 4) as logs:
        logs.start(ME, TUNE, {"step": 1, "losses": [1.0]})
        logs.committed({"step": 2, "losses": [1.0, 0.5]}, {2: 10.0})
    assert not (tmp_path / "tensorboard").exists()
