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
