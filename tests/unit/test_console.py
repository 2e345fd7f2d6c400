"""Progress outside a terminal: one plain line at a steady pace, at checkpoints once the work
has run that long, and at the end; nothing for work shorter than the pace."""

from __future__ import annotations

import pytest

from spill import console


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def lines(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln]


def test_a_line_every_interval_with_rate_and_eta(capsys, monkeypatch):
    monkeypatch.delenv("SPILL_PROGRESS", raising=False)
    monkeypatch.setenv("SPILL_PROGRESS_EVERY", "30")
    bar = console.progress(80, "tune", unit="step", initial=10)  # stderr is not a terminal here
    assert isinstance(bar, console.Lines)
    clock = Clock()
    bar.clock, bar.start, bar.last = clock, clock.now, clock.now
    with bar:
        for _ in range(20):  # 2 s a step: a line every 15 steps
            clock.now += 2
            bar.set_postfix(loss="1.2345", tok_s="120")
            bar.update(1)
            if bar.n in (15, 28):  # at 15 the work has run 10 s: too early for a line
                bar.checkpoint("checkpoint committed")
    assert lines(capsys) == [
        "tune: step 25/80 (31%), loss 1.2345, tok/s 120, 2.00 s/step, ETA 1m50s",
        "tune: step 28/80 (35%), loss 1.2345, tok/s 120, 2.00 s/step, ETA 1m44s, "
        "checkpoint committed",
        "tune: step 30/80 (38%), loss 1.2345, tok/s 120, 2.00 s/step, ETA 1m40s",  # at the end
    ]


def test_short_work_prints_nothing_and_switches_work(capsys, monkeypatch):
    monkeypatch.setenv("SPILL_PROGRESS_EVERY", "30")
    monkeypatch.delenv("SPILL_PROGRESS", raising=False)
    with console.progress(5, "eval") as bar:
        bar.update(5)
        bar.checkpoint("5 rows committed")
    assert lines(capsys) == []
    for how, kind in (("0", console.Lines), ("lines", console.Lines)):
        monkeypatch.setenv("SPILL_PROGRESS", how)
        assert isinstance(console.progress(5, "eval"), kind)
    monkeypatch.setenv("SPILL_PROGRESS", "bar")
    assert not isinstance(console.progress(5, "eval"), console.Lines)


@pytest.mark.parametrize("seconds, text", [(5, "5s"), (150, "2m30s"), (7300, "2h01m")])
def test_durations(seconds, text):
    assert console._duration(seconds) == text
