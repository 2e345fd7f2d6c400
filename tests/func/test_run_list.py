"""Issue 19, items 4 and 11, through real ``spill`` processes: a run's control object is the
authority, and the fixed names under ``runs/`` say in one line what is wrong with them.

* ``runs/current.json`` deleted under a stopped build (local and on the S3 server): ``spill
  status`` reads the run list from the control objects and writes nothing; the next build
  rebuilds it (SIGKILLed right after, at ``control-rebuild``: every payload the old run points at
  is untouched, and the build after that accepts the state), continues the run from its
  committed step 4 and ends equal to an uninterrupted build. No payload name is written twice.
* Two unfinished runs and no run list: refused in one line that names both, nothing written.
* Every control object deleted, the payloads left: the new run's generation is above theirs.
* The run after an edit (the completed run its parent) clears and collects its stages without
  removing anything the completed run's control object points at.
* ``runs/control.lock`` (and ``runs/``, ``current.json``, a ``control.json``) replaced by a
  folder, a link or a named pipe: one line naming what to remove; once removed, the build goes on.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from spill.store import fs
from tests.func import move_kit as mk

CKPT = f"stages/tune/payloads/ckpt-g1-s{mk.STOP}-0"  # the stopped build's newest checkpoint
_GEN = re.compile(r"(?:^|/)payloads/[a-z]+-g(\d+)-s\d+-\d+/")


@pytest.fixture
def control(tmp_path_factory) -> dict:
    return mk.control(tmp_path_factory)


def files(state: str) -> dict[str, tuple[bytes, object]]:
    """Every file under ``state`` with its bytes and what changes when it is written again (the
    inode and mtime of a local file, an object's LastModified); ``runs/control.lock`` left out."""
    out = {}
    for rel, data in mk.tree(state).items():
        uri = fs.join(state, rel)
        if fs.is_local(uri):
            st = os.stat(uri)
            stamp: object = (st.st_ino, st.st_mtime_ns)
        else:
            s3, path = fs.filesystem(uri)
            s3.invalidate_cache(path)
            stamp = s3.info(path)["LastModified"]
        out[rel] = (data, stamp)
    return out


def assert_no_name_written_twice(before: dict, after: dict) -> None:
    """A payload file there before and after is the same write; every payload folder made since
    has a generation above every one there before."""
    old = {int(m[1]) for rel in before if (m := _GEN.search(rel))}
    for rel, got in after.items():
        if (m := _GEN.search(rel)) is None:
            continue
        if rel in before:
            assert got == before[rel], f"{rel} was written again"
        else:
            assert int(m[1]) > max(old, default=0), f"{rel} reuses a generation"


def stopped(where: str, tmp_path: Path, tmp_path_factory, request) -> tuple[str, list[str], dict]:
    """(project root as outcome() reads it, the build's arguments, environment): the toy build
    stopped after tune:STOP, its state in the project or on the S3 server."""
    if where == "local":
        root = mk.copy_of_stopped(tmp_path_factory, tmp_path / "toy")
        return str(root), [str(root)], mk.env_for(tmp_path / "home")
    bucket = request.getfixturevalue("s3_bucket")
    env = mk.env_for(tmp_path / "home")  # after the bucket: the AWS_* variables reach children
    project = mk.project(tmp_path / "toy")
    root = f"s3://{bucket}/toy"
    args = [str(project), "--state", mk.state_of(root)]
    mk.ok(mk.spill("build", *args, "--stop-after", f"tune:{mk.STOP}", env=env, cwd=tmp_path))
    return root, args, env


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.slow)])
def test_a_deleted_run_list_is_rebuilt_and_the_build_continues_the_run(
    where, control, tmp_path, tmp_path_factory, request
):
    root, args, env = stopped(where, tmp_path, tmp_path_factory, request)
    state = mk.state_of(root)
    old = mk.doc(root)
    listed = fs.join(state, "runs", "current.json")
    fs.remove(listed)
    before = files(state)
    said = f"the control object of 1 run: current is run {old['run']} (active, generation 1, "

    shown = mk.ok(mk.spill("status", *args, env=env, cwd=tmp_path))
    assert f"note: {listed} is missing; read from {said}" in shown.stdout, shown.stdout
    assert files(state) == before, "spill status wrote something"

    killed = mk.spill("build", *args, env=env, cwd=tmp_path, drill="control-rebuild")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert f"{listed} was missing; rebuilt from {said}{old['created']})" in killed.stderr
    rebuilt = files(state)
    runs = json.loads(rebuilt.pop("runs/current.json")[0])
    assert runs["runs"] == [old["run"]] == [runs["current"]]
    assert rebuilt == before, "the rebuild changed more than the run list"
    assert f"{CKPT}/COMMIT" in rebuilt and mk.doc(root) == old

    built = mk.ok(mk.spill("build", *args, env=env, cwd=tmp_path))
    assert f"== tune: continue at step {mk.STOP} of {mk.STEPS}" in built.stderr
    assert f"continuing toy from {fs.join(state, CKPT)}: step {mk.STOP} of" in built.stderr
    assert "was missing" not in built.stderr
    mk.assert_same(mk.outcome(root), control)
    now = mk.doc(root)
    assert now["run"] == old["run"] and now["generation"] == 2
    assert_no_name_written_twice(before, files(state))


def test_two_unfinished_runs_without_a_run_list_are_refused_in_one_line(tmp_path, tmp_path_factory):
    root = mk.copy_of_stopped(tmp_path_factory, tmp_path / "toy")
    env, runs = mk.env_for(tmp_path / "home"), root / ".spill" / "runs"
    (a,) = [p.name for p in runs.iterdir() if p.is_dir()]
    other = json.loads((runs / a / "control.json").read_text())
    other.update(run="20000101-000000-abcdef", generation=1, created="2000-01-01T00:00:00Z")
    (runs / other["run"]).mkdir()
    (runs / other["run"] / "control.json").write_text(json.dumps(other))  # an older build's
    (runs / "current.json").unlink()
    before = files(str(root / ".spill"))
    for verb in ("build", "status"):
        proc = mk.spill(verb, str(root), env=env, cwd=tmp_path)
        assert proc.returncode == 1, proc.stderr
        line = mk.last_line(proc.stderr)
        assert proc.stderr.strip() == line and line.startswith("spill: error: ")
        assert "is missing and more than one run there is unfinished: " in line
        assert f"{a} (active, generation 1," in line and f"{other['run']} (active" in line
        assert f"move the others' folders out of {runs}" in line
    assert files(str(root / ".spill")) == before


def test_a_state_whose_control_objects_were_deleted_never_reuses_a_payload_name(
    tmp_path, tmp_path_factory
):
    root = mk.copy_of_stopped(tmp_path_factory, tmp_path / "toy")
    env, state = mk.env_for(tmp_path / "home"), str(root / ".spill")
    shutil.rmtree(root / ".spill" / "runs")
    before = files(state)
    assert f"{CKPT}/COMMIT" in before
    built = mk.ok(mk.spill("build", str(root), env=env, cwd=tmp_path))
    assert "== tune: fresh" in built.stderr  # no control object: nothing is known to be done
    now = mk.doc(str(root))
    assert now["generation"] == 2 and now["status"] == "complete"
    assert now["lineage"]["parent"] is None
    assert_no_name_written_twice(before, files(state))


def test_the_run_after_an_edit_keeps_what_the_completed_run_points_at(tmp_path):
    root = mk.project(tmp_path / "toy")
    env, state = mk.env_for(tmp_path / "home"), str(root / ".spill")
    mk.ok(mk.spill("build", str(root), env=env, cwd=tmp_path))
    first = mk.doc(str(root))
    before = files(state)
    pointed = {
        rel: got
        for rel, got in before.items()
        if any(rel.startswith(p + "/") for ps in first["pointers"].values() for p in ps)
    }
    homes = {rel.split("payloads/")[0] for rel in pointed}
    assert homes == {"", "stages/eval-base/", "stages/tune/", "stages/eval/"}
    built = mk.ok(mk.spill("build", str(root), "tune.lr=0.004", env=env, cwd=tmp_path))
    assert "== tune: fresh" in built.stderr and "== eval: " in built.stderr
    second = mk.doc(str(root))
    assert second["lineage"]["parent"] == first["run"] and second["generation"] == 2
    after = files(state)
    assert {rel: after.get(rel) for rel in pointed} == pointed  # every pointed file, untouched
    assert after[f"runs/{first['run']}/control.json"] == before[f"runs/{first['run']}/control.json"]
    assert_no_name_written_twice(before, after)


CASES = {
    "lock-folder": ("runs/control.lock", "a folder", True),
    "lock-link": ("runs/control.lock", "a link", True),
    "lock-pipe": ("runs/control.lock", "a named pipe", True),
    "list-folder": ("runs/current.json", "a folder", True),
    "control-folder": ("runs/{id}/control.json", "a folder", False),
    "runs-file": ("runs", "a file", False),
}


@pytest.mark.parametrize("case", CASES)
def test_a_fixed_name_under_runs_that_holds_something_else_is_one_line(
    case, tmp_path, tmp_path_factory
):
    root = mk.copy_of_stopped(tmp_path_factory, tmp_path / "toy")
    env, spill_dir = mk.env_for(tmp_path / "home"), root / ".spill"
    rid = mk.doc(str(root))["run"]
    rel, kind, recoverable = CASES[case]
    path = spill_dir / rel.format(id=rid)
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        if case == "control-folder":
            path.rename(tmp_path / "control.json")
        else:
            path.unlink()
    if kind == "a folder":
        (path / "inside").mkdir(parents=True)
    elif kind == "a link":
        path.symlink_to(tmp_path / "nowhere" / "lock")
    elif kind == "a named pipe":
        os.mkfifo(path)
    else:
        path.write_text("not spill's\n")
    before = sorted(str(p.relative_to(spill_dir)) for p in spill_dir.rglob("*"))
    proc = mk.spill("build", str(root), env=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"spill: error: {path} is {kind}, not ")
    assert f"; remove it (rm -r {path})" in proc.stderr
    assert sorted(str(p.relative_to(spill_dir)) for p in spill_dir.rglob("*")) == before
    if recoverable:  # doing what the line says is enough
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        built = mk.ok(mk.spill("build", str(root), env=env, cwd=tmp_path))
        assert f"== tune: continue at step {mk.STOP} of {mk.STEPS}" in built.stderr
