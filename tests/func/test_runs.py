"""A project's runs through real builds: completion, the next run after an edit, read-only past.

A build whose every stage is done completes its run (one fenced transition); building again
without a change answers from it and writes nothing; an edit of spill.yaml after completion
starts a new run whose lineage names the completed one, and the completed run's control object
never changes again.
"""

from __future__ import annotations

import json
from pathlib import Path

from spill.control.keys import current
from spill.store.location import location
from tests.func.test_build import copy_toy, spill

FAST = ("tune.steps=4", "tune.ckpt_every=2")


def control_files(state: Path) -> dict[str, bytes]:
    return {p.parent.name: p.read_bytes() for p in sorted((state / "runs").glob("*/control.json"))}


def test_an_edit_after_completion_starts_the_next_run(tmp_path):
    home = tmp_path / "home"
    project = copy_toy(tmp_path / "toy")
    state = project / ".spill"
    spill("build", str(project), *FAST, home=home)
    first = current(location(state))
    assert first["status"] == "complete" and first["lineage"]["parent"] is None
    before = control_files(state)
    again = spill("build", str(project), *FAST, home=home)  # nothing to do: nothing written
    assert "== " not in again.stderr and control_files(state) == before
    spill("build", str(project), *FAST, "tune.lr=0.004", home=home)
    second = current(location(state))
    assert second["run"] != first["run"] and second["lineage"]["parent"] == first["run"]
    assert second["status"] == "complete" and second["generation"] > first["generation"]
    after = control_files(state)
    assert after[first["run"]] == before[first["run"]]  # the completed run is read-only
    runs = json.loads((state / "runs" / "current.json").read_text())
    assert runs["runs"] == [first["run"], second["run"]] and runs["current"] == second["run"]
    status = json.loads(spill("status", str(project), "--json", home=home).stdout)
    assert status["run"]["id"] == second["run"] and status["run"]["parent"] == first["run"]


def test_a_location_inside_what_a_run_writes_is_refused_a_sweeps_is_not(tmp_path):
    import pytest

    from spill.control.ownership import acquire
    from spill.errors import StoreError

    acquire(location(tmp_path)).release()  # a build's state: its own runs
    for inside in ("stages/tune", "payloads/x", "runs/y"):
        with pytest.raises(StoreError, match="holds runs of its own"):
            acquire(location(tmp_path / inside))
    acquire(location(tmp_path / "sweep" / "tune.lr=0.1")).release()  # a sweep's build: its own run
