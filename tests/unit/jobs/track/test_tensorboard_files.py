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
    again.close("FINISHED")
    assert logged(tmp_path / "tb") == {"train/loss": 3, "train/lr": 1}

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/loss")] == [(1, 2.0), (2, 1.5), (3, 1.25)]
