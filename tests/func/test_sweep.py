"""``spill build DIR -m ...``: Hydra's multirun, each combination its own build and state,
through the basic launcher (in process) and the joblib launcher (worker processes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import build_state_file, run_spill

ROOT = Path(__file__).resolve().parents[2]
FAST = ["tune.steps=8", "tune.ckpt_every=4"]


@pytest.fixture
def toy(tmp_path) -> Path:
    dst = tmp_path / "toy"
    shutil.copytree(ROOT / "projects" / "toy", dst, ignore=shutil.ignore_patterns(".spill"))
    return dst


def sweep(toy: Path, *args: str) -> tuple[int, dict, str]:
    proc = run_spill("build", str(toy), "-m", *FAST, *args, "--json")
    return proc.returncode, json.loads(proc.stdout or "{}"), proc.stderr


def check_runs(result: dict, toy: Path, lrs=("0.005", "0.01")) -> list[dict]:
    runs = result["runs"]
    assert [r["run"] for r in runs] == [f"tune.steps=8,tune.ckpt_every=4,tune.lr={x}" for x in lrs]
    for r in runs:
        assert r["status"] == "done", r
        assert r["steps"] == 8 and r["base"] is not None and r["tuned"] is not None
        state = toy / ".spill" / "sweep" / r["run"]
        doc = json.loads(build_state_file(state).read_text())
        assert doc["config"]["tune"]["lr"] == float(r["run"].rsplit("=", 1)[1])
        assert (state / "adapters" / "toy" / "params.safetensors").is_file()
    return runs


def test_basic_launcher_two_jobs_and_again(toy):
    rc, result, err = sweep(toy, "tune.lr=0.005,0.01")
    assert rc == 0, err
    runs = check_runs(result, toy)
    assert {r["pid"] for r in runs} == {result["pid"]}  # the basic launcher runs in process
    # the same sweep again: each job finds its own finished build
    rc, again, err = sweep(toy, "tune.lr=0.005,0.01")
    assert rc == 0 and "== " not in err
    assert [(r["base"], r["tuned"]) for r in again["runs"]] == [
        (r["base"], r["tuned"]) for r in runs
    ]
    status = json.loads(run_spill("status", str(toy), "--json").stdout)
    assert [(r["run"], r["status"], r["tuned"]) for r in status["runs"]] == [
        (r["run"], "done", r["tuned"]) for r in runs
    ]


def test_joblib_launcher_two_jobs_in_worker_processes(toy):
    rc, result, err = sweep(
        toy, "tune.lr=0.005,0.01", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"
    )
    assert rc == 0, err
    runs = check_runs(result, toy)
    assert result["pid"] not in {r["pid"] for r in runs}


def test_a_failing_job_does_not_lose_the_others(toy):
    proc = run_spill("build", str(toy), "-m", *FAST, "tune.rank=4,0", "--stop-after", "eval:base")
    assert proc.returncode == 1, proc.stderr
    lines = proc.stdout.splitlines()
    assert any("tune.rank=4" in x and " stopped " in x for x in lines), proc.stdout
    assert any(
        "tune.rank=0" in x and "tune.rank: 0 is less than the minimum of 1" in x for x in lines
    )


def test_status_of_a_stopped_sweep_shows_committed_steps(toy):
    proc = run_spill("build", str(toy), "-m", *FAST, "tune.lr=0.005,0.01", "--stop-after", "tune:4")
    assert proc.returncode == 0, proc.stderr
    status = json.loads(run_spill("status", str(toy), "--json").stdout)
    assert [(r["status"], r["steps"]) for r in status["runs"]] == [("stopped", 4)] * 2
