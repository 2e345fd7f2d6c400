"""Outputs that would destroy data, and words that misled, through the real CLI (issue 35 items
1, 2, 22, 26, 27) on one tiny toy build (8 steps, seconds) made once for the module.

* ``--out``/``-o`` naming a FIFO or a character device (made here with ``os.mkfifo`` and
  ``os.mknod``, never under /dev) is written into; the node is never replaced by a file. A
  folder or a block device is refused in one line before anything runs (exit 2).
* An output that is a project's spill.yaml, its data file or anything under its ``.spill/`` (by
  any path: a symlink, a hard link) is refused in one line (exit 2), the project left byte for
  byte as it was, for predict, run, eval, distill, report and export.
* A tune checkpoint whose producer range has a string ``to_step``: ``spill report`` is one line
  naming the file, not a traceback.
* ``spill export PROJECT/.spill`` on a finished build exports its published adapter; on an
  unfinished one it says to resume the build.
* ``spill status --state S`` on a predict job's state says to ask ``spill status S``, not to build.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import threading
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_spill

FAST = ["tune.steps=8", "tune.ckpt_every=4"]
MODEL = "tiny:llama:2:2x64"  # the toy project's model, generated from its seed on first use


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


def spill(home: Path, *args, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {"SPILL_HOME": str(home), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    return run_spill(*map(str, args), env=env, cwd=cwd, timeout=300)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def one_line(proc: subprocess.CompletedProcess, code: int, ran: bool = False) -> str:
    """The one error line; nothing else on stderr unless the job ``ran`` (its progress lines)."""
    assert proc.returncode == code, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("spill: error: ")]
    assert "Traceback" not in proc.stderr and errors == lines[-1:], proc.stderr
    assert ran or len(lines) == 1, proc.stderr
    return lines[-1]


def toy(where: Path) -> Path:
    shutil.copytree(ROOT / "projects" / "toy", where, ignore=shutil.ignore_patterns(".spill"))
    return where


@pytest.fixture(scope="module")
def built(tmp_path_factory, home) -> Path:
    project = toy(tmp_path_factory.mktemp("built") / "toy")
    ok(spill(home, "build", project, *FAST))
    return project


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    """Every entry under ``folder``: its file type and, for a file, its bytes."""
    out = {}
    for p in sorted(folder.rglob("*")):
        kind = stat.S_IFMT(p.lstat().st_mode)
        out[str(p.relative_to(folder))] = (kind, p.read_bytes() if p.is_file() else b"")
    return out


@pytest.fixture
def inputs(tmp_path, built) -> Path:
    """Four of the toy's rows as a predict input (CSV, its ``text`` column), and as run/eval
    rows (JSONL, prompt and answer)."""
    rows = (built / "toy.csv").read_text().splitlines()[1:5]
    (tmp_path / "in.csv").write_text("text\n" + "\n".join(r.split(",")[0] for r in rows) + "\n")
    lines = [json.dumps({"prompt": r.split(",")[0], "answer": r.split(",")[1]}) for r in rows]
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    return tmp_path


def device(path: Path, kind: int, major: int, minor: int) -> Path:
    try:
        os.mknod(path, kind | 0o666, os.makedev(major, minor))
    except PermissionError:
        pytest.skip("making a device node needs root (CAP_MKNOD)")
    return path


# --- item 1: FIFOs and devices --------------------------------------------------------------


def test_run_writes_into_a_fifo_and_leaves_it_one(home, inputs):
    fifo = inputs / "answers"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    proc = spill(home, "run", MODEL, inputs / "rows.jsonl", "--out", fifo, "--max-new-tokens", 2)
    ok(proc)
    reader.join(timeout=60)
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    lines = got[0].decode().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [1, 2, 3, 4]  # numbered from 1


def test_report_into_a_character_device_keeps_the_node(home, built, tmp_path):
    null = device(tmp_path / "null", stat.S_IFCHR, 1, 3)  # what /dev/null is
    ok(spill(home, "report", built, "-o", null))
    assert stat.S_ISCHR(null.lstat().st_mode) and os.listdir(tmp_path) == ["null"]


def test_predict_into_a_full_device_is_one_line_and_keeps_the_node(home, built, inputs):
    full = device(inputs / "full", stat.S_IFCHR, 1, 7)  # what /dev/full is: ENOSPC on write
    line = one_line(spill(home, "predict", built, inputs / "in.csv", "--out", full), 1, ran=True)
    assert "No space left on device" in line
    assert stat.S_ISCHR(full.lstat().st_mode) and full.lstat().st_rdev == os.makedev(1, 7)
    assert not list(inputs.glob(".full*"))  # no temporary beside it


@pytest.mark.parametrize("kind", ["folder", "block device"])
def test_a_folder_or_block_device_is_refused_before_anything_runs(home, built, inputs, kind):
    out = inputs / "out"
    if kind == "folder":
        out.mkdir()
    else:
        device(out, stat.S_IFBLK, 7, 0)  # a loop device's numbers: never opened
    before = snapshot(inputs)
    for verb in (["predict", built, inputs / "in.csv"], ["run", MODEL, inputs / "rows.jsonl"]):
        line = one_line(spill(home, *verb, "--out", out), 2)
        assert f"--out {out} is a {kind}, not a file" in line and " · model " not in line
    assert snapshot(inputs) == before


# --- item 2: a project's own files and state -----------------------------------------------


@pytest.fixture
def linked(built, tmp_path) -> dict[str, Path]:
    """Other names for the build's files: a symlink to spill.yaml, a hard link to its data."""
    os.symlink(built / "spill.yaml", tmp_path / "conf.yaml")
    os.link(built / "toy.csv", tmp_path / "same.csv")
    return {"symlink": tmp_path / "conf.yaml", "hardlink": tmp_path / "same.csv"}


def cases(built: Path, inputs: Path, linked: dict[str, Path]) -> list[tuple[list, str]]:
    """(command line, what the refusal names) for every verb with an output."""
    state = built / ".spill"
    rows, csv = inputs / "rows.jsonl", inputs / "in.csv"
    return [
        (["report", built, "-o", built / "spill.yaml"], "the spill.yaml of the project"),
        (["report", built, "-o", state / "runs" / "current.json"], "inside the state folder"),
        (["report", built, "-o", linked["symlink"]], "the spill.yaml of the project"),
        (["predict", built, csv, "--out", built / "toy.csv"], "the data file of the project"),
        (["predict", built, csv, "--out", linked["hardlink"]], "the data file of the project"),
        (["predict", built, csv, "--out", state / "runs" / "current.json"], "inside the state"),
        (["run", MODEL, rows, "--out", built / "spill.yaml"], "the spill.yaml of the project"),
        (["eval", MODEL, rows, "--out", state / "files" / "eval.jsonl"], "inside the state"),
        (["distill", MODEL, rows, "--out", built / "toy.csv"], "the data file of the project"),
        (["export", state / "adapters" / "toy", state / "exports" / "x"], "inside the state"),
    ]


def test_an_output_among_a_projects_files_is_refused(home, built, inputs, linked):
    before = snapshot(built)
    for argv, what in cases(built, inputs, linked):
        line = one_line(spill(home, *argv), 2)
        assert what in line and "write the results elsewhere" in line, (argv, line)
        assert snapshot(built) == before, argv


def test_a_projects_config_files_are_kept_too(home, built, inputs, tmp_path):
    """A group option beside spill.yaml (tune/mine.yaml) and the schema copy are the project's
    own files as spill.yaml is; a new YAML name there is not."""
    project = tmp_path / "toy"
    shutil.copytree(built, project)
    (project / "tune").mkdir()
    (project / "tune" / "mine.yaml").write_text("lr: 0.001\n")
    (project / "spill.schema.json").write_text("{}\n")
    before = snapshot(project)
    for out in (project / "tune" / "mine.yaml", project / "spill.schema.json"):
        line = one_line(spill(home, "report", project, "-o", out), 2)
        assert "a config file of the project" in line, line
        assert snapshot(project) == before, out
    rows = inputs / "rows.jsonl"
    ok(spill(home, "run", MODEL, rows, "--out", project / "tune" / "answers.yaml"))


# --- item 22: a checkpoint state with a string to_step --------------------------------------


def test_a_string_to_step_is_one_line_naming_the_file(home, built, tmp_path):
    project = tmp_path / "toy"
    shutil.copytree(built, project)
    (newest,) = (project / ".spill" / "stages" / "tune" / "payloads").glob("ckpt-*-s8-*")
    doc = json.loads((newest / "state.json").read_text())
    doc["producers"][0]["to_step"] = "8"
    (newest / "state.json").write_text(json.dumps(doc))
    line = one_line(spill(home, "report", project, "-o", tmp_path / "r.html"), 1)
    assert str(newest / "state.json") in line and "producers/0/to_step" in line
    assert "move the file away" in line and not (tmp_path / "r.html").exists()


# --- item 26: export a build's state ----------------------------------------------------------


def test_export_of_a_finished_builds_state_exports_its_adapter(home, built, tmp_path):
    out = tmp_path / "hf"
    ok(spill(home, "export", built / ".spill", out, "--json"))
    record = json.loads((out / "export.json").read_text())
    assert Path(record["adapter"]["folder"]).resolve() == built / ".spill" / "adapters" / "toy"


def test_export_of_an_unfinished_build_says_to_resume_it(home, tmp_path):
    project = toy(tmp_path / "toy")
    ok(spill(home, "build", project, *FAST, "--stop-after", "tune:4"))
    line = one_line(spill(home, "export", project / ".spill", tmp_path / "hf"), 1)
    assert "tune stage is not done (step 4 of 8)" in line
    assert f"`spill resume {project / '.spill'}`" in line
    assert not (tmp_path / "hf").exists()


# --- item 27: status of a job's state -------------------------------------------------------


def test_status_of_a_predict_jobs_state_says_spill_status_of_it(home, built, inputs):
    ok(spill(home, "predict", built, "in.csv", "--out", "o.jsonl", "--state", "pst", cwd=inputs))
    line = one_line(spill(home, "status", built, "--state", "pst", cwd=inputs), 1)
    assert "`spill predict` job's state: `spill status pst` shows it" in line
    assert "spill build" not in line
    ok(spill(home, "status", "pst", cwd=inputs))  # what it points at works
