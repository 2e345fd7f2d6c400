"""``spill.jobs.track.tracking``: what a committed state adds to each tracker, once per step.

A fake tracker stands in for TensorBoard and MLflow here (their own readers are in
tests/func/test_trackers.py); what is checked is the bookkeeping: per metric, only the steps
after those the tracker holds, back-filled from the state, in step order.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from spill.jobs.schedule import cosine_lr
from spill.jobs.track.tracking import Tracking, metric_name, series
from spill.store import drill

TUNE = SimpleNamespace(lr=0.01, warmup=2, steps=6)


class Fake:
    name = "fake"

    def __init__(self, last: dict[str, int] | None = None, fail: bool = False) -> None:
        self.last = dict(last or {})
        self.points: list[tuple[int, str, float]] = []
        self.fail = fail
        self.closed: list[str | None] = []

    def write(self, points):
        if self.fail:
            raise ConnectionError("server gone")
        self.points += points

    def close(self, status):
        self.closed.append(status)


def state(step: int, valid=()) -> dict:
    losses = [10.0 - i for i in range(step)]
    return {"step": step, "losses": losses, "valid": [list(v) for v in valid]}


def test_series_are_the_states_losses_and_the_schedule_steps_applied():
    got = series({"step": 3, "losses": [3.0, None, 1.0], "valid": [[2, 2.5]]}, TUNE, {3: 99.0})
    assert got["train/loss"] == {1: 3.0, 3: 1.0}  # a non-finite loss is stored as None: skipped
    # step s (1-based) applied the rate of optimizer step s - 1 (tune_steps.Steps.apply)
    assert got["train/lr"] == {s: cosine_lr(s - 1, 0.01, 2, 6) for s in (1, 2, 3)}
    assert got["train/lr"][1] == 0.0 and got["train/lr"][3] == 0.01  # warmup, then the peak
    assert got["valid/loss"] == {2: 2.5}
    assert got["train/tokens_per_s"] == {3: 99.0}


def test_each_commit_logs_only_the_steps_a_tracker_lacks():
    fresh, behind = Fake(), Fake({"train/loss": 3, "train/lr": 2})
    t = Tracking([fresh, behind], TUNE)
    t.committed(state(2), {1: 5.0, 2: 6.0})
    t.committed(state(4), {1: 5.0, 2: 6.0, 3: 7.0, 4: 8.0})
    t.committed(state(4), {})  # the same commit again (a resume that had nothing to run)
    assert t.flush(10)
    steps = lambda b, k: [s for s, key, _ in b.points if key == k]  # noqa: E731
    for key in ("train/loss", "train/lr"):
        assert steps(fresh, key) == [1, 2, 3, 4]
    assert steps(behind, "train/loss") == [4] and steps(behind, "train/lr") == [3, 4]
    assert steps(fresh, "train/tokens_per_s") == [1, 2, 3, 4]
    assert [p[0] for p in fresh.points] == sorted(p[0] for p in fresh.points)  # step order
    assert fresh.last["train/loss"] == 4 and t.step == 4


def test_steps_committed_by_a_dead_process_are_back_filled_without_a_rate():
    b = Fake({"train/loss": 2, "train/lr": 2, "train/tokens_per_s": 2})
    t = Tracking([b], TUNE)
    t.committed(state(6, valid=[(4, 1.5)]), {5: 50.0, 6: 60.0})
    assert t.flush(10)
    assert {(s, k) for s, k, _ in b.points} == {
        *((s, k) for s in (3, 4, 5, 6) for k in ("train/loss", "train/lr")),
        (5, "train/tokens_per_s"),
        (6, "train/tokens_per_s"),
        (4, "valid/loss"),
    }
    assert [k for s, k, _ in b.points if s == 4] == ["valid/loss", "train/loss", "train/lr"]


def test_a_tracker_that_fails_is_dropped_not_the_run(capsys):
    bad, good = Fake(fail=True), Fake()
    t = Tracking([bad, good], TUNE)
    t.committed(state(2), {})
    assert t.flush(10)
    assert t.backends == [good] and len(good.points) == 4
    assert "warning: logging to fake failed (server gone)" in capsys.readouterr().err
    t.close("KILLED")
    assert good.closed == ["KILLED"] and bad.closed == []


def test_results_are_logged_once_at_their_step():
    b = Fake()
    t = Tracking([b])
    t.metrics({"eval:base/accuracy": 0.5, "eval:base/rows": 3, "labels": {"a": 1}, "x": None})
    t.metrics({"eval:base/accuracy": 0.5})  # a rerun of the finished stage
    assert t.flush(10)
    assert b.points == [(0, "eval_base/accuracy", 0.5), (0, "eval_base/rows", 3.0)]
    assert metric_name("eval:base/accuracy") == "eval_base/accuracy"


def test_a_drill_point_between_two_trackers():
    reached = []
    with drill.hooked(reached.append):
        t = Tracking([Fake(), Fake()], TUNE)
        t.committed(state(1), {})
        t.close()
    assert reached.count(drill.TRACK_LOGGED) == 2


def test_no_tracker_needs_no_settings():
    t = Tracking([])  # what a job without --log holds: nothing is computed
    t.committed(state(3), {1: 1.0})
    assert t.step == 3
    assert "train/lr" not in series(state(1), None, {})  # results only: no schedule


class Hung(Fake):
    """A tracker whose writes wait until ``release`` is set (a server that stops answering)."""

    name = "hung"

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def write(self, points):
        self.entered.set()
        self.release.wait(30)
        super().write(points)


def test_a_commit_never_waits_on_a_tracker_and_the_end_waits_a_bounded_time(capsys):
    """A tracker that hangs holds neither the commits nor the other tracker; the end waits
    ``within`` seconds and says so in one line."""
    hung, other = Hung(), Fake()
    t = Tracking([hung, other], TUNE)
    t0 = time.monotonic()
    for step in range(1, 7):  # every commit while the tracker's first write hangs
        t.committed(state(step), {})
    assert hung.entered.wait(10)
    assert time.monotonic() - t0 < 5  # (generous: the commits only merge into a dict)
    assert not t.flush(0.2)
    t.close("FINISHED", within=0.5)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "warning: logging to hung did not finish within 0.5 s; "
        "the next run of the same command back-fills what it lacks"
    ], err
    assert [s for s, k, _ in other.points if k == "train/loss"] == [1, 2, 3, 4, 5, 6]
    assert other.closed == ["FINISHED"]
    hung.release.set()  # the late sender still writes what it took: none lost, none twice
    for sender in t._senders.values():
        sender.thread.join(10)
    steps = [s for s, k, _ in hung.points if k == "train/loss"]
    assert steps == sorted(set(steps)) and steps[-1] == 6
    assert hung.closed == ["FINISHED"]
