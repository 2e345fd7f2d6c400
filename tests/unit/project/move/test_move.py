"""``spill.project.move.move`` in process: where things go, what is copied and checked, reruns.

A bare state location (a job's ``--state``) is moved here, so no build runs: a run with one
pointed payload, beside litter a move must leave behind (an unpointed payload, a temporary file).
An interruption is an exception raised at a step's drill point (``drill.hooked``); the same
``move`` then finishes the same transfer. Real processes and SIGKILL: tests/func/test_move.py.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from spill.control.keys import current
from spill.control.owner import home_of
from spill.control.ownership import acquire
from spill.errors import StoreError, UsageError
from spill.project.move import move as mv
from spill.store import drill
from spill.store.fs import put_bytes
from spill.store.location import Location, location

STEPS = ("quiesce", "take", "copy", "verify", "incoming", "fence", "activate")


def _state(where: Path, *, complete: bool = False) -> dict:
    """A run at ``where`` with one pointed checkpoint payload and some litter."""
    run = acquire(location(where))
    place = run.place("job")
    uri = place.payload("ckpt", 2)
    put_bytes(f"{uri}/params.bin", b"\x01" * 1000)
    put_bytes(f"{uri}/COMMIT", b"{}\n")
    place.publish("ckpt", [uri])
    put_bytes(f"{place.payload('ckpt', 4)}/params.bin", b"never published")
    (where / "job" / ".tmp-killed").write_bytes(b"half")
    put_bytes(str(where / "job" / "state.json"), b'{"cursor": 2}\n')
    run.complete() if complete else run.release()
    return current(location(where))


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.parts[len(root.parts)] != "runs"
    }


WANTED = {"job/payloads/ckpt-g1-s2-0/COMMIT", "job/payloads/ckpt-g1-s2-0/params.bin"}
WANTED |= {"job/state.json"}


def test_locations_of_a_project_and_of_a_bare_state(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "spill.yaml").write_text("name: x\n")
    got = mv.locations(location(proj), location(tmp_path / "to"), None)
    assert got == (str(proj), f"{proj}/.spill", str(tmp_path / "to"), f"{tmp_path}/to/.spill")
    assert all(isinstance(x, Location) for x in got)  # parsed once, by the caller
    _state(tmp_path / "state")
    got = mv.locations(location(tmp_path / "state"), location("s3://b/p/"), None)
    assert got == (None, str(tmp_path / "state"), "s3://b/p", "s3://b/p")
    with pytest.raises(UsageError) as e:
        mv.locations(location(tmp_path / "nothing"), location(tmp_path / "to"), None)
    assert str(e.value) == f"{tmp_path}/nothing is neither a project folder nor a state location"


@pytest.mark.parametrize("to", ["proj", "proj/sub", "proj/.spill/x", "."])
def test_overlapping_places_are_refused(tmp_path, to):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "spill.yaml").write_text("name: x\n")
    with pytest.raises(UsageError) as e:
        mv.locations(location(proj), location(tmp_path / to), None)
    assert str(e.value).endswith("overlap; move to a location outside the project")


def test_a_state_moves_with_its_pointed_payloads_only_and_a_checked_manifest(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    before = _state(src)
    result = mv.move(location(src), location(dst))
    assert result["status"] == "active" and result["files"] == len(WANTED)
    assert set(_files(dst)) == WANTED  # no unpointed payload, no temporary file
    assert all(_files(dst)[r] == _files(src)[r] for r in WANTED)
    manifest = json.loads(
        (dst / "runs" / before["run"] / f"move-{result['transfer']}.json").read_text()
    )
    assert manifest["kind"] == "spill-move" and manifest["project"] is False
    assert {e["path"] for e in manifest["files"]} == WANTED
    assert manifest["bytes"] == result["bytes"] == sum(len(_files(dst)[r]) for r in WANTED)
    there = current(location(dst))
    assert there["status"] == "active" and there["pointers"] == before["pointers"]
    assert there["home"] == home_of(location(dst))
    assert current(location(src))["status"] == "transferred"


@pytest.mark.parametrize("step", STEPS)
def test_an_interrupted_move_is_finished_by_the_same_move(tmp_path, step):
    src, dst = tmp_path / "src", tmp_path / "dst"
    before = _state(src)

    def crash(boundary: str) -> None:
        if boundary == f"move-{step}":
            raise RuntimeError(f"interrupted at {boundary}")

    with drill.hooked(crash), pytest.raises(RuntimeError):
        mv.move(location(src), location(dst), lease=0.3)  # this process lives on: its lease lets go
    tid = current(location(src))["transfer"]["id"]
    result = mv.move(location(src), location(dst))
    assert result["transfer"] == tid and result["status"] == "active"
    assert set(_files(dst)) == WANTED
    assert current(location(dst))["pointers"] == before["pointers"]
    assert current(location(src))["status"] == "transferred"


def test_a_rerun_copies_again_a_damaged_partial_copy(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _state(src)

    def crash(boundary: str) -> None:
        if boundary == "move-copy":
            raise RuntimeError("interrupted")

    with drill.hooked(crash), pytest.raises(RuntimeError):
        mv.move(location(src), location(dst))
    (dst / "job" / "state.json").write_bytes(b"damaged")
    (dst / "job" / "payloads" / "ckpt-g1-s2-0" / "COMMIT").unlink()
    mv.move(location(src), location(dst))
    assert {r: _files(dst)[r] for r in WANTED} == {r: _files(src)[r] for r in WANTED}


def test_verify_names_a_file_that_differs_or_is_missing(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    doc = _state(src)
    doc["transfer"] = {"id": "0123456789abcdef", "from": "h:/x", "to": str(dst), "step": "take"}
    manifest = mv.copy_snapshot(None, location(src), location(dst), location(dst), doc)
    mv.verify(location(dst), manifest)
    (dst / "job" / "state.json").write_bytes(b'{"cursor": 3}\n')
    with pytest.raises(StoreError) as e:
        mv.verify(location(dst), manifest)
    assert str(e.value).startswith(f"{dst}/job/state.json does not match what was copied (14 ")
    (dst / "job" / "state.json").unlink()
    with pytest.raises(StoreError) as e:
        mv.verify(location(dst), manifest)
    assert str(e.value) == (
        f"{dst}/job/state.json is missing after the copy; run `spill move` again"
    )


def test_a_destination_holding_other_files_is_refused_before_the_source_changes(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    before = _state(src)
    (dst / "job").mkdir(parents=True)
    (dst / "job" / "mine.txt").write_text("x")
    with pytest.raises(StoreError) as e:
        mv.move(location(src), location(dst))
    assert (
        str(e.value) == f"{dst} is not empty (job/mine.txt, ...); move to a new or empty location"
    )
    assert current(location(src)) == before and _files(dst) == {"job/mine.txt": b"x"}


def test_memory_is_refused_as_a_destination(tmp_path):
    _state(tmp_path / "src")
    with pytest.raises(UsageError) as e:
        mv.move(location(tmp_path / "src"), location("memory://b/p"))
    assert "memory:// lives only inside one process" in str(e.value)


def test_a_complete_run_is_copied_and_the_source_stays_as_it_was(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    before = _state(src, complete=True)
    result = mv.move(location(src), location(dst))
    assert result["status"] == "complete"
    assert current(location(src)) == before
    there = current(location(dst))
    assert there["status"] == "complete" and there["pointers"] == before["pointers"]
    assert there["lineage"]["copied_from"] == before["home"]
    assert set(_files(dst)) == WANTED
    again = mv.move(location(src), location(dst))  # a rerun answers from the copy
    assert again["transfer"] == result["transfer"] and current(location(dst)) == there


def test_a_symlink_or_a_file_uri_into_the_source_overlaps(tmp_path):
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "spill.yaml").write_text("name: x\n")
    (tmp_path / "alias").symlink_to(proj)
    with pytest.raises(UsageError) as e:
        mv.locations(location(proj), location(tmp_path / "alias" / "in"), None)
    assert str(e.value) == (
        f"{tmp_path}/alias/in (that is {proj}/in) and {proj} overlap; move to a location "
        "outside the project"
    )
    with pytest.raises(UsageError):
        mv.locations(location(proj), location(f"file://{proj}/in"), None)
    got = mv.locations(location(proj), location(f"file://{tmp_path}/to"), None)
    assert got[2:] == (str(tmp_path / "to"), f"{tmp_path}/to/.spill")


def test_an_interrupted_move_is_aborted_and_its_partial_copy_removed(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    before = _state(src)

    def crash(boundary: str) -> None:
        if boundary == "move-copy":
            raise RuntimeError("interrupted")

    with drill.hooked(crash), pytest.raises(RuntimeError):
        mv.move(location(src), location(dst), lease=0.3)
    assert set(WANTED) <= set(_files(dst))
    time.sleep(0.35)  # the interrupted mover's lease runs out
    result = mv.abort(location(src))
    assert result["destination"] == "cleaned" and result["status"] == "active"
    assert [p for p in dst.rglob("*") if p.is_file()] == [dst / "runs" / "control.lock"]
    here = current(location(src))
    assert here["generation"] == before["generation"] + 2  # the mover's take, then the abort's
    assert here["pointers"] == before["pointers"] and here["transfer"]["aborted"]
    assert mv.move(location(src), location(dst))["status"] == "active"  # moved anew, as any run


def test_a_rerun_whose_destination_is_someone_elses_aborts_the_move(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    _state(src)

    def crash(boundary: str) -> None:
        if boundary == "move-take":
            raise RuntimeError("interrupted")

    with drill.hooked(crash), pytest.raises(RuntimeError):
        mv.move(location(src), location(dst), lease=0.3)
    time.sleep(0.35)
    shutil.rmtree(dst)  # emptied by hand, and someone else's run made there
    theirs = acquire(location(dst))
    theirs.release()
    left = current(location(src))
    with pytest.raises(StoreError) as e:
        mv.move(location(src), location(dst))
    assert str(e.value) == (
        f"{dst} holds run {theirs.id} (active), not this move's claim: the move of run "
        f"{left['run']} to {dst} is aborted, and the run is active again at {src} (generation "
        f"{left['generation'] + 1}); move it to another place"
    )
    here = current(location(src))
    assert here["status"] == "active" and here["transfer"]["aborted"]
    assert current(location(dst))["run"] == theirs.id
