"""What ``spill bundle --with-state`` and ``spill move`` carry of a state (issue 35, items 4 and
7), through the real CLI: a project with a build and two sweep jobs arrives with every job
whole (its payloads too), so ``spill report`` and ``spill status`` read every job there as at
the source; a symbolic link under the state that leads out of it (``adapters/``, ``files/``,
``exports/``) is refused in one line naming it, and the outside file's bytes land nowhere.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_spill
from tests.func.test_build import copy_toy

FAST = ("tune.steps=8", "tune.ckpt_every=4")
SECRET = b"outside-the-state-7c1e9a secret bytes"


def spill(*args: str, home: Path) -> object:
    return run_spill(*args, env={"SPILL_HOME": str(home), "HF_HUB_OFFLINE": "1"}, timeout=300)


def ok(proc):
    assert proc.returncode == 0, proc.stderr
    return proc


def refused(proc, *names: str) -> str:
    """The one line of a refusal (exit 1), naming each of ``names``."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("spill: error: ") and all(n in lines[0] for n in names), lines
    return lines[0]


def jobs(project: Path, home: Path) -> dict[str, dict]:
    """Every run ``spill report`` reads (the build and each sweep job): its scores."""
    doc = json.loads(ok(spill("report", str(project), "--json", home=home)).stdout)
    return {r["name"]: r["scores"] for r in doc["runs"]}


@pytest.fixture(scope="module")
def swept(tmp_path_factory) -> dict:
    """The toy project built once and swept over two learning rates (8 steps each)."""
    base = tmp_path_factory.mktemp("carry")
    home = base / "home"
    project = copy_toy(base / "toy")
    ok(spill("build", str(project), *FAST, home=home))
    ok(spill("build", str(project), "-m", *FAST, "tune.lr=0.005,0.01", home=home))
    runs = jobs(project, home)
    assert len(runs) == 3, runs  # the build and its two jobs
    return {"base": base, "home": home, "project": project, "runs": runs}


def _job_states(project: Path) -> list[Path]:
    return sorted((project / ".spill" / "sweep").iterdir())


def _assert_jobs_whole(project: Path, home: Path, want: dict[str, dict]) -> None:
    assert jobs(project, home) == want
    for job in _job_states(project):
        status = ok(spill("status", str(project), "--state", str(job), "--json", home=home))
        assert json.loads(status.stdout)["stages"]["tune"]["status"] == "done"
        assert any((job / "payloads").iterdir())  # what its control object points at


def test_bundle_with_state_carries_each_sweep_job_whole(swept, tmp_path):
    home, path = swept["home"], tmp_path / "toy.spb"
    ok(spill("bundle", str(swept["project"]), str(path), "--with-state", home=home))
    dest = tmp_path / "installed"
    ok(spill("bundle", "--install", str(path), str(dest), home=tmp_path / "home2"))
    _assert_jobs_whole(dest, tmp_path / "home2", swept["runs"])
    # the sweep launcher's folder names this machine's paths and pids: never carried
    assert (swept["project"] / ".spill" / "hydra").is_dir()
    assert not (dest / ".spill" / "hydra").exists()


def test_move_carries_each_sweep_job_whole(swept, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(swept["project"], src, symlinks=True)
    dest = tmp_path / "moved"
    ok(spill("move", str(src), str(dest), home=swept["home"]))
    _assert_jobs_whole(dest, swept["home"], swept["runs"])


def _everything_under(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


@pytest.mark.parametrize("where", ["adapters/toy/notes.txt", "files/extra.jsonl", "exports/toy/x"])
def test_a_link_out_of_the_state_is_never_followed(swept, tmp_path, where):
    src = tmp_path / "src"
    shutil.copytree(swept["project"], src, symlinks=True)
    outside = tmp_path / "outside.txt"
    outside.write_bytes(SECRET)
    link = src / ".spill" / where
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(outside, link)
    home = swept["home"]
    exports = ["--with-exports"] if where.startswith("exports/") else []
    path = tmp_path / "toy.spb"
    proc = spill("bundle", str(src), str(path), "--with-state", *exports, home=home)
    refused(proc, str(link), "symbolic link")
    assert not path.exists() and not [p for p in tmp_path.iterdir() if ".spb" in p.name]
    dest = tmp_path / "moved"
    refused(spill("move", str(src), str(dest), *exports, home=home), str(link), "symbolic link")
    assert not dest.exists() or SECRET not in _everything_under(dest)
    assert jobs(src, home) == swept["runs"]  # the source as it was
    # without the link both go, and the bundle holds none of the outside file's bytes
    link.unlink()
    ok(spill("bundle", str(src), str(path), "--with-state", *exports, home=home))
    assert SECRET not in path.read_bytes()


def test_a_link_inside_the_state_is_carried_as_its_file(swept, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(swept["project"], src, symlinks=True)
    state = src / ".spill"
    os.symlink(state / "files" / "train.jsonl", state / "files" / "again.jsonl")
    dest = tmp_path / "moved"
    ok(spill("move", str(src), str(dest), home=swept["home"]))
    copied = dest / ".spill" / "files" / "again.jsonl"
    assert not copied.is_symlink()
    assert copied.read_bytes() == (state / "files" / "train.jsonl").read_bytes()


# --- one writer per run: a sweep job carried by bundle and move (issue 35 item 4, follow-up) ---

SWEEP = ("-m", *FAST, "tune.lr=0.005,0.01")
HALF = ("--stop-after", "tune:4")


def _run_of(job: Path) -> tuple[list[str], dict]:
    """A job state's run list and its current run's control object."""
    listing = json.loads((job / "runs" / "current.json").read_text())
    control = job / "runs" / listing["current"] / "control.json"
    return listing["runs"], json.loads(control.read_text())


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` but the lock files a refused writer may leave."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "control.lock"
    }


def _sweep_rows(proc) -> dict[str, dict]:
    """What ``spill build -m --json`` says of each job."""
    return {r["run"]: r for r in json.loads(proc.stdout)["runs"]}


@pytest.fixture(scope="module")
def halfway(tmp_path_factory) -> dict:
    """The toy project's build and its two sweep jobs, each stopped at step 4 of 8 (their runs
    unfinished: a build there continues them)."""
    base = tmp_path_factory.mktemp("halfway")
    home = base / "home"
    project = copy_toy(base / "toy")
    ok(spill("build", str(project), *FAST, *HALF, home=home))
    ok(spill("build", str(project), *SWEEP, *HALF, home=home))
    runs = {job.name: _run_of(job)[1] for job in _job_states(project)}
    assert len(runs) == 2 and {d["status"] for d in runs.values()} == {"active"}, runs
    return {"home": home, "project": project, "runs": runs}


def test_an_installed_sweep_job_is_a_copy_that_forks_and_the_source_continues(halfway, tmp_path):
    home, src = halfway["home"], tmp_path / "src"
    shutil.copytree(halfway["project"], src, symlinks=True)
    path, dest, home2 = tmp_path / "toy.spb", tmp_path / "installed", tmp_path / "home2"
    ok(spill("bundle", str(src), str(path), "--with-state", home=home))
    ok(spill("bundle", "--install", str(path), str(dest), home=home2))
    for job in _job_states(dest):
        runs, doc = _run_of(job)
        original = halfway["runs"][job.name]
        # as the bundled run: a copy, released, its run list naming it alone, no source path
        assert runs == [original["run"]] and doc["status"] == "copy", doc
        assert doc["owner"]["released"] and doc["pointers"] == original["pointers"]
        assert doc["lineage"]["copied_from"].startswith("a bundle from ")
        assert sorted(p.name for p in (job / "runs").iterdir()) == sorted(
            ["current.json", doc["run"]]
        )
        assert str(src) not in json.dumps(doc) and doc["home"].endswith(str(job))
    before = {job.name: _files(job) for job in _job_states(dest)}
    # the copy is never continued: each job refused in one line of its row, its files as they were
    proc = spill("build", str(dest), *SWEEP, "--json", home=home2)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    rows = _sweep_rows(proc)
    assert sorted(rows) == sorted(halfway["runs"]), rows
    for row in rows.values():
        assert row["status"] == "error" and "is a copy" in row["error"], row
        assert "--new-run" in row["error"], row
    assert {job.name: _files(job) for job in _job_states(dest)} == before
    # the original stays the one that continues each run
    proc = ok(spill("build", str(src), *SWEEP, "--json", home=home))
    assert {r["status"] for r in _sweep_rows(proc).values()} == {"done"}
    for job in _job_states(src):
        runs, doc = _run_of(job)
        assert runs == [halfway["runs"][job.name]["run"]] and doc["status"] == "complete"
    # the copy forks with --new-run: a new run whose parent is the copied one, which stays a copy
    proc = ok(spill("build", str(dest), *SWEEP, "--new-run", "--json", home=home2))
    assert {(r["status"], r["steps"]) for r in _sweep_rows(proc).values()} == {("done", 8)}
    for job in _job_states(dest):
        runs, doc = _run_of(job)
        original = halfway["runs"][job.name]["run"]
        assert len(runs) == 2 and runs[0] == original and doc["run"] != original, runs
        assert doc["lineage"]["parent"] == original and doc["status"] == "complete"
        copied = json.loads((job / "runs" / original / "control.json").read_text())
        assert copied["status"] == "copy"


def test_a_finished_sweep_job_installed_is_done_and_writes_no_run(swept, tmp_path):
    path, dest, home2 = tmp_path / "toy.spb", tmp_path / "installed", tmp_path / "home2"
    ok(spill("bundle", str(swept["project"]), str(path), "--with-state", home=swept["home"]))
    ok(spill("bundle", "--install", str(path), str(dest), home=home2))
    before = {job.name: _run_of(job) for job in _job_states(dest)}
    assert {doc["status"] for _, doc in before.values()} == {"copy"}
    proc = ok(spill("build", str(dest), *SWEEP, "--json", home=home2))
    assert {r["status"] for r in _sweep_rows(proc).values()} == {"done"}
    assert {job.name: _run_of(job) for job in _job_states(dest)} == before


def test_move_refuses_an_unfinished_sweep_job_and_carries_finished_ones(halfway, tmp_path):
    home, src, dest = halfway["home"], tmp_path / "src", tmp_path / "moved"
    shutil.copytree(halfway["project"], src, symlinks=True)
    before = _files(src / ".spill")
    line = refused(spill("move", str(src), str(dest), home=home), "unfinished", "sweep job")
    assert str(_job_states(src)[0]) in line and "finish it" in line
    assert not dest.exists() and _files(src / ".spill") == before
    # finished at the source (the same runs continued there), then moved: read-only at both
    # places, so a sweep at either is done and writes no run, and the build's run is fenced
    ok(spill("build", str(src), *SWEEP, home=home))
    ok(spill("move", str(src), str(dest), home=home))
    refused(spill("build", str(src), *FAST, home=home), "moved to")
    for place in (src, dest):
        runs = {job.name: _run_of(job) for job in _job_states(place)}
        assert {doc["status"] for _, doc in runs.values()} == {"complete"}
        assert {n: r[0] for n, r in runs.items()} == {
            n: [d["run"]] for n, d in halfway["runs"].items()
        }
        proc = ok(spill("build", str(place), *SWEEP, "--json", home=home))
        assert {r["status"] for r in _sweep_rows(proc).values()} == {"done"}
        assert {job.name: _run_of(job) for job in _job_states(place)} == runs
