"""``spill.jobs.track.tensorboard_files``: event files read back with TensorBoard's own reader."""

from __future__ import annotations

import pytest

pytest.importorskip("tensorboard", reason="tensorboard is in the test extra")

from spill.jobs.track.tensorboard_files import TensorBoard, logged  # noqa: E402
from spill.jobs.track.tracking import Tracking  # noqa: E402


def test_a_reopened_folder_knows_its_newest_step_per_tag(tmp_path):
    tb = TensorBoard(tmp_path / "tb")
    assert tb.last == {} and list((tmp_path / "tb").iterdir()) == []  # no file before a write
    tb.write([(1, "train/loss", 2.0), (1, "train/lr", 0.1), (2, "train/loss", 1.5)])
    tb.close("KILLED")  # a later leg, another file
    again = TensorBoard(tmp_path / "tb")
    assert again.last == {"train/loss": 2, "train/lr": 1}
    t = Tracking([again], None)
    t.committed({"step": 3, "losses": [2.0, 1.5, 1.25]}, {})
    t.close("FINISHED")  # what the sender has left is written first
    assert logged(tmp_path / "tb") == {"train/loss": 3, "train/lr": 1}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 1.5), (3, 1.25)]

    files = sorted(p.name for p in (tmp_path / "tb").iterdir())
    assert len(files) == 2 and all(f.startswith("events.out.tfevents.") for f in files)


def test_an_unwritable_folder_is_one_warning_line_and_no_thread_traceback(tmp_path, capfd):
    """The event file cannot be made (a directory stands where it would go): the tracking says
    it once; no writer thread of TensorBoard's prints a traceback of its own."""
    tb = TensorBoard(tmp_path / "tb")
    tb.logdir = tmp_path / "missing"  # a folder that is not there: open() fails, as read-only
    t = Tracking([tb], None)
    t.committed({"step": 1, "losses": [2.0]}, {})
    t.close("FINISHED")
    err = capfd.readouterr().err
    assert err.count("warning: logging to tensorboard failed") == 1, err
    assert "Traceback" not in err and "Exception in thread" not in err, err
    assert t.backends == []
