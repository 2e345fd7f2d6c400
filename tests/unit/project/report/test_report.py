"""``spill report``'s parts from files alone: the loss series and sparkline of a checkpoint's
state (with a validation series faked in, which a real build adds only with validation on), the
producer ranges of a stage's job state, the swept parameters, and the page drawn from them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from spill.project.build import stages
from spill.project.report import series
from spill.project.report.html import page
from spill.project.report.report import BUILD, swept
from spill.project.report.status import as_json, render
from spill.store.location import location

LINUX = {"engine": "torch", "numerics": "float32", "machine": "box", "os": "Linux 6.1 (x86_64)"}
MAC = {"engine": "mlx", "numerics": "bfloat16", "machine": "mac", "os": "macOS 15.1 (arm64)"}


def test_sparkline():
    assert series.sparkline([4, 3, 2, 1]) == "█▆▃▁"
    assert series.sparkline([1, None, 3]) == "▁ █"  # a step whose loss was not finite
    assert series.sparkline([2.0] * 5) == "▁▁▁▁▁"
    assert len(series.sparkline([float(i) for i in range(1000)])) == series.WIDTH
    assert series.sparkline([]) == "" and series.sparkline([None, None]) == "  "


def checkpoint_state(step: int, **given) -> dict:
    """A tune checkpoint's ``state.json`` that its schema accepts, ``given`` over it."""
    return {
        "schema_version": 1,
        "step": step,
        "seed": 0,
        "cursor": step,
        "model": {"id": "tiny", "fingerprint": "sha256:" + "f" * 64},
        "adapter": {"rank": 4, "alpha": 8.0, "targets": ["q_proj"]},
        "hyperparameters": {"steps": step},
        "losses": [1.0] * step,
        "producers": [],
        **given,
    }


def _checkpoint(root: str, state: dict, step: int = 6) -> None:
    from spill.control.ownership import acquire

    tune = acquire(root).place("stages/tune")
    d = Path(tune.payload("ckpt", step))
    d.mkdir(parents=True)
    (d / "state.json").write_text(json.dumps(checkpoint_state(step, **state)))
    (d / "COMMIT").write_text("{}")
    tune.publish("ckpt", [str(d)])


def test_losses_and_the_lines_under_the_table(tmp_path):
    root = location(tmp_path)
    assert series.losses(root) is None
    state = {
        "losses": [2.0, 1.5, None, 1.0, 0.8, 0.5],
        "valid": [[3, 1.6], [6, 1.1]],  # what validation adds: [step, loss] pairs
        "producers": [
            {"from_step": 0, "to_step": 4, **LINUX, "hardware": "cpu"},
            {"from_step": 4, "to_step": 6, **MAC, "hardware": "M4"},
        ],
    }
    _checkpoint(root, state)
    found = series.losses(root)
    assert found == {"step": 6, "train": state["losses"], "valid": state["valid"]}
    lines = series.lines(found)
    assert lines[0] == "tune loss   █▆ ▃▂▁  2 → 0.5 (6 steps)"
    assert lines[1] == "tune valid  █▁  1.6 → 1.1 (2 points)"
    summary = {"doc": {"stages": {}}, "losses": {"tune": found}}
    assert "tune valid  █▁" in render(summary)
    assert as_json(summary)["losses"]["tune"]["valid"] == [[3, 1.6], [6, 1.1]]
    assert as_json({"doc": {}})["losses"] == {}
    ranges = stages.get("tune").ranges(root)
    assert [(r["from"], r["to"], r["producer"]["engine"]) for r in ranges] == [
        (0, 4, "torch"),
        (4, 6, "mlx"),
    ]


def _run(name: str, overrides: list[str], acc: float, valid: bool) -> dict:
    losses = {"step": 4, "train": [3.0, 2.0, 1.5, 1.0]}
    if valid:
        losses["valid"] = [[2, 2.5], [4, 1.4]]
    made = {"label": "torch float32 on box (Linux 6.1)", "producer": LINUX}
    return {
        "name": name,
        "label": name,
        "project": "toy",
        "state": f"/s/{name}",
        "overrides": overrides,
        "table": [{"stage": "tune", "status": "done", "result": "4 of 4 steps", "ran on": "x"}],
        "notes": [],
        "losses": losses,
        "scores": {
            "eval:base": {"accuracy": 0.1, "logprob/token": -3.0},
            "eval": {"accuracy": acc, "logprob/token": -1.0},
        },  # fmt: skip
        "timeline": [
            {"stage": "tune", "unit": "step", "total": 4, "ranges": [{"from": 0, "to": 4, **made}]}
        ],  # fmt: skip
        "models": [
            {
                "stage": "tune",
                "model": "tiny",
                "quantize": None,
                "pinned": "tiny",
                "fingerprint": "sha256:" + "a" * 64,
                "quantization": None,
                "files": ["x"],
                "stage_fingerprint": "sha256:" + "b" * 64,
            }
        ],  # fmt: skip
        "data": None,
    }


def test_swept_parameters_and_the_page():
    runs = [
        _run("tune.lr=0.01,tune.rank=4", ["tune.lr=0.01", "tune.rank=4"], 0.5, True),
        _run("tune.lr=0.001,tune.rank=4", ["tune.lr=0.001", "tune.rank=4"], 0.9, False),
    ]
    keys = swept(runs)
    assert list(keys) == ["tune.lr"]  # the rank is the same in both
    assert [p["value"] for p in keys["tune.lr"]] == [0.01, 0.001]
    report = {"project": "toy", "folder": "/p", "state": "/s", "generated": "now", "runs": runs}
    html = page({**report, "swept": keys})
    assert "<script" not in html and not re.search(r"\s(src|href)=", html)
    loss = re.search(r'<svg[^>]*data-chart="loss".*?</svg>', html, re.S).group(0)
    names = re.findall(r'class="series" data-series="([^"]*)"', loss)
    assert names == [
        "tune.lr=0.01,tune.rank=4 train",
        "tune.lr=0.01,tune.rank=4 validation",
        "tune.lr=0.001,tune.rank=4 train",
    ]
    assert loss.count('class="point"') == 2 and 'stroke-dasharray="5 3"' in loss
    acc = re.search(r'<svg[^>]*data-chart="score:accuracy:tune.lr".*?</svg>', html, re.S)
    assert acc and acc.group(0).count('class="point"') == 4
    assert 'data-producer="torch float32 on box (Linux 6.1)"' in html
    assert "sha256:aaaaaaaaaaaa" in html

    # one build, no sweep: no score chart, a line that says why
    one = page({**report, "runs": [{**runs[0], "name": BUILD, "label": BUILD}], "swept": {}})
    assert 'data-chart="score:' not in one and "not a sweep" in one
    # a categorical sweep value: its names on the x axis
    cat = [_run("a", ["tune.targets=all"], 0.2, False), _run("b", ["tune.targets=qv"], 0.4, False)]
    html = page({**report, "runs": cat, "swept": swept(cat)})
    assert ">qv</text>" in html and ">all</text>" in html


def test_a_checkpoint_state_off_its_schema_is_one_line_naming_it(tmp_path):
    """A producer range whose ``to_step`` is a string: every reader of the newest checkpoint
    (ranges, losses, probe) is refused where the file is read, naming it and the field."""
    from spill.ground.validate import SchemaInvalid

    root = location(tmp_path)
    bad = {"from_step": 0, "to_step": "6", **LINUX, "hardware": "cpu"}
    _checkpoint(root, {"producers": [bad]})
    tune = stages.get("tune")
    for read in (tune.ranges, tune.probe, series.losses):
        with pytest.raises(SchemaInvalid) as e:
            read(root)
        message = str(e.value)
        assert "\n" not in message and "ckpt-g1-s6-0/state.json" in message
        assert "producers/0/to_step" in message and "move the file away" in message
