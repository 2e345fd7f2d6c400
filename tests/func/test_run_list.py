"""Issue 19, item 4, through real ``spill`` processes: a run's control object is the authority.

* Every control object deleted, the payloads left: the new run's generation is above theirs.
* The run after an edit (the completed run its parent) clears and collects its stages without
  removing anything the completed run's control object points at.
"""

from __future__ import annotations

import os
import re
import shutil

from spill.store import fs
from tests.func import move_kit as mk

CKPT = f"stages/tune/payloads/ckpt-g1-s{mk.STOP}-0"  # the stopped build's newest checkpoint
_GEN = re.compile(r"(?:^|/)payloads/[a-z]+-g(\d+)-s\d+-\d+/")


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
