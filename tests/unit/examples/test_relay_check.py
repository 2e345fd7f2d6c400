"""The relay's ledger checks on hand-made committed states: producer ranges that leave a gap,
overlap, stop early or disagree with the losses; row segments that repeat, miss or add rows."""

from __future__ import annotations

from spill.examples.relay_check import _ran_on, rows_once, steps_once


def span(a: int, b: int, engine: str = "torch") -> dict:
    return {"from_step": a, "to_step": b, "engine": engine, "machine": "m", "os": "Linux 6"}


def ckpt(step: int, losses: int | None = None) -> dict:
    return {"step": step, "losses": [0.0] * (step if losses is None else losses)}


def test_steps_once():
    assert steps_once(ckpt(8), [span(0, 4), span(4, 8, "mlx")], 8) == ""
    assert steps_once(ckpt(8), [span(0, 4), span(6, 8)], 8) == "steps 4-6 missing"
    assert steps_once(ckpt(8), [span(0, 4), span(2, 8)], 8) == "steps 2-4 repeated"
    assert "not 8" in steps_once(ckpt(6), [span(0, 6)], 8)
    assert steps_once(ckpt(8, losses=7), [span(0, 8)], 8) == "7 losses for 8 steps"
    assert steps_once(None, [], 8) == "no committed tune checkpoint"
    assert "steps 0-2 missing" == steps_once(ckpt(8), [span(2, 8)], 8)


def test_rows_once():
    seg = [{"row_ids": [1, 2]}, {"row_ids": [3]}]
    assert rows_once(seg, [1, 2, 3]) == ""
    assert rows_once([*seg, {"row_ids": [2]}], [1, 2, 3]) == "1 rows repeated (first 2)"
    assert rows_once(seg, [1, 2, 3, 4]) == "1 rows missing (first 4)"
    assert rows_once(seg, [1, 2]) == "1 rows not held out (first 3)"


def test_ran_on_compares_engine_machine_and_os():
    leg = {"engine": "torch", "machine": "m", "os": "Linux 6"}
    assert _ran_on([span(0, 4)], leg) == ""
    assert _ran_on([span(0, 4, "mlx")], leg) == "recorded mlx on m (Linux 6)"
    assert _ran_on([], leg) == "no producer recorded"
    assert _ran_on([span(0, 4) | {"os": "macOS 15"}], leg).endswith("(macOS 15)")
