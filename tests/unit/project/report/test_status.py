"""The build table and the stages' probes, from files alone (no engine, no model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from spill.errors import StoreError
from spill.project.build import record, stages
from spill.project.report.status import as_json, render, rows
from spill.store.location import location
from tests.unit.project.report.test_report import checkpoint_state

LINUX = {
    "engine": "torch",
    "numerics": "float32",
    "machine": "box",
    "os": "Linux 6.1 (x86_64)",
    "hardware": "cpu",
}
MAC = {
    "engine": "mlx",
    "numerics": "bfloat16",
    "machine": "mac",
    "os": "macOS 15.1 (arm64)",
    "hardware": "M4",
}


def doc():
    base = {"unit": "row", "total": 40, "progress": 40, "location": "x", "updated": "t"}
    return {
        "stages": {
            "eval:base": {
                **base,
                "status": "done",
                "result": {"rows": 40, "correct": 2, "accuracy": 0.05},
                "producers": [LINUX],
            },
            "distill": {**base, "status": "skipped", "result": {}, "producers": []},
            "tune": {
                **base,
                "unit": "step",
                "total": 300,
                "status": "done",
                "result": {"step": 300, "steps": 300, "loss": 0.01},
                "producers": [LINUX, MAC],
            },
            "eval": {**base, "status": "stopped", "progress": 7, "result": {}, "producers": [MAC]},
        }
    }


def test_rows_and_a_stage_that_moved():
    table = rows(doc())
    assert [r["status"] for r in table] == ["done", "skipped", "done", "stopped", "not run"]
    assert table[0]["result"] == "accuracy 0.050 (2/40)"
    assert table[2]["ran on"] == (
        "torch float32 on box (Linux 6.1) + mlx bfloat16 on mac (macOS 15.1)"
    )
    assert table[3]["result"] == "at row 7 of 40"
    assert rows(None)[0]["status"] == "not run"
    text = render({"doc": doc(), "notes": ["spill.yaml changed since"]})
    assert "note: spill.yaml changed since" in text
    assert as_json({"doc": doc()})["stages"]["tune"]["producers"] == [LINUX, MAC]


def test_probes_read_commits_only(tmp_path):
    """Probes read what the run points at: a committed payload's state.json or a segment's
    COMMIT, never a folder nobody points at, nor a pointed folder removed by hand."""
    from spill.control.ownership import acquire

    root = location(tmp_path)
    run = acquire(root)
    tune = run.place("stages/tune")
    made = {}
    for step in (10, 20, 30):
        d = Path(tune.payload("ckpt", step))
        d.mkdir(parents=True)
        ranges = [{"from_step": 0, "to_step": 5, **LINUX}, {"from_step": 5, "to_step": step, **MAC}]
        (d / "state.json").write_text(json.dumps(checkpoint_state(step, producers=ranges)))
        (d / "COMMIT").write_text("{}")
        made[step] = str(d)
    tune.publish("ckpt", [made[20], made[10]])  # 30 landed but never became current
    assert stages.get("tune").probe(root) == (20, [LINUX, MAC])
    shutil.rmtree(made[20])
    assert stages.get("tune").probe(root) == (10, [LINUX, MAC])
    rows = run.place("stages/eval")
    segs = []
    for n, producer in enumerate([LINUX, LINUX, MAC]):
        d = Path(rows.payload("rows", n))
        d.mkdir(parents=True)
        (d / "COMMIT").write_text(json.dumps({"count": 5, "producer": producer}))
        segs.insert(0, str(d))
    rows.publish("rows", segs)
    (Path(rows.payload("rows", 3)) / "rows.jsonl").parent.mkdir(parents=True)
    assert stages.get("eval").probe(root) == (15, [LINUX, MAC])
    # spill report's timeline: the rows each producer made, in commit order
    ranges = [(r["from"], r["to"], r["producer"]) for r in stages.get("eval").ranges(root)]
    assert ranges == [(0, 10, LINUX), (10, 15, MAC)]
    assert stages.get("eval").pinned(root) is None  # no identity pinned
    assert stages.get("distill").probe(root) == (0, [])


def test_state_file_kind_and_version(tmp_path):
    from spill.control.ownership import acquire

    assert record.read(location(tmp_path)) is None
    run = acquire(location(tmp_path))
    place = run.place()
    d = Path(place.payload("state", 1))
    d.mkdir(parents=True)
    place.publish("state", [str(d)])
    (d / "state.json").write_text(json.dumps({"kind": "other"}))
    with pytest.raises(StoreError, match="not a spill build state"):
        record.read(location(tmp_path))
    (d / "state.json").write_text(json.dumps({"kind": "spill-build", "schema_version": 9}))
    with pytest.raises(StoreError, match="version 9"):
        record.read(location(tmp_path))
    (d / "state.json").write_text("{")
    with pytest.raises(StoreError, match="not JSON"):
        record.read(location(tmp_path))
    (d / "state.json").unlink()
    with pytest.raises(StoreError, match="is missing"):
        record.read(location(tmp_path))


def test_a_state_of_an_older_spill_is_refused_in_one_line(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"kind": "spill-build"}))
    with pytest.raises(StoreError, match="written by an older spill"):
        record.read(location(tmp_path))


def test_outputs_recorded_checked_cheaply_and_shown_out_of_date(tmp_path):
    """A finished stage's outputs: recorded with hashes; a touch costs a hash but changes
    nothing, a same-size flip or a deletion makes it (and, unrestorable, what reads it) out of
    date in the table, with no result shown for a stage that must rerun."""
    import os

    from spill.project.report.status import _check_outputs

    root = location(tmp_path)
    adapter = tmp_path / "adapters" / "p"
    (adapter / "peft").mkdir(parents=True)
    (adapter / "params.safetensors").write_bytes(b"params")
    (adapter / "peft" / "adapter_model.safetensors").write_bytes(b"peft")
    (adapter / ".params.safetensors.tmp-123").write_bytes(b"litter")
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "eval.jsonl").write_bytes(b'{"id": 1}\n')
    rec = stages.TUNE.record(root, "p")
    assert sorted(rec) == [
        "adapters/p/params.safetensors",
        "adapters/p/peft/adapter_model.safetensors",
    ]
    assert rec["adapters/p/params.safetensors"]["size"] == 6
    assert stages.TUNE.problem(root, "p", rec) == ""
    os.utime(adapter / "params.safetensors", ns=(1, 1))  # touched: hashed, still the same
    assert stages.TUNE.problem(root, "p", rec) == ""
    (adapter / "params.safetensors").write_bytes(b"paRams")
    assert stages.TUNE.problem(root, "p", rec) == "adapters/p/params.safetensors changed"
    assert stages.TUNE.problem(root, "p", None) == ""  # an old record: existence only
    (adapter / "params.safetensors").write_bytes(b"params")
    (adapter / "peft" / "adapter_model.safetensors").unlink()
    assert stages.TUNE.problem(root, "p", rec).endswith("peft/adapter_model.safetensors missing")

    d = doc()
    d["project"] = {"name": "p"}
    d["stages"]["eval"].update(status="done", result={"rows": 40, "correct": 40, "accuracy": 1.0})
    d["stages"]["eval"]["outputs"] = stages.EVAL.record(root, "p")
    d["stages"]["tune"]["outputs"] = rec
    # eval:base: a record without outputs (older spill), and files/eval-base.jsonl is missing
    notes = _check_outputs(d, root)
    assert notes == [
        "eval:base: files/eval-base.jsonl missing; `spill build` runs it again",
        "tune: adapters/p/peft/adapter_model.safetensors missing; `spill build` runs it again",
        "eval: tune reruns first; `spill build` runs it again",
    ]
    table = rows(d)
    assert [r["status"] for r in table] == [
        "out of date", "skipped", "out of date", "out of date", "not run",
    ]  # fmt: skip
    assert table[3]["result"] == "tune reruns first" and d["stages"]["eval"]["result"] == {}
    assert as_json({"doc": d})["stages"]["tune"]["problem"].endswith("missing")
