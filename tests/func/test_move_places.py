"""Issue 19's evidence for places that are not what they look like (items 7, 8 and 9, the move
parts), each the issue's repro through the real CLI.

* Refused in one line, nothing changed at the source, nothing written at the destination: a
  destination reached through a symlink into the project (``alias/inner``), one inside another
  run's state (``O/.spill/stages/evil``), a regular file and a folder below one, ``ftp://``
  (without a connection: the host does not exist), a 256-byte path segment, and a destination
  too deep for the longest path the snapshot holds (a write probe there, removed with its
  folders).
* ``file:///abs/path`` is the local path it names: a move lands there (not in ``./file:``),
  ``spill build``, ``spill status`` and ``spill resume`` take it, and so does ``--state``; a
  ``file://`` destination inside the project is refused like the path itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.func import move_kit as mk


@pytest.fixture
def control(tmp_path_factory) -> dict:
    return mk.control(tmp_path_factory)


@pytest.fixture
def src(tmp_path, tmp_path_factory) -> str:
    return str(mk.copy_of_stopped(tmp_path_factory, tmp_path / "src"))


@pytest.fixture
def env(tmp_path) -> dict:
    return mk.env_for(tmp_path / "home")


def test_a_symlink_into_the_project_is_refused_like_the_path_it_resolves_to(src, env, tmp_path):
    alias = tmp_path / "alias"
    alias.symlink_to(src)
    line = mk.refused(src, str(alias / "inner"), env, tmp_path, code=2)
    assert line == (
        f"spill: error: {alias}/inner (that is {src}/inner) and {src} overlap; move to a "
        "location outside the project"
    )
    assert not (Path(src) / "inner").exists()


def test_a_destination_inside_another_runs_state_is_refused(src, env, tmp_path, tmp_path_factory):
    other = mk.copy_of_stopped(tmp_path_factory, tmp_path / "O")
    before = mk.tree(str(other))
    to = f"{other}/.spill/stages/evil"
    line = mk.refused(src, to, env, tmp_path)
    assert line == (
        f"spill: error: {to} lies inside {other}/.spill, which holds runs of its own (a state "
        "location); move to a location outside it"
    )
    assert mk.tree(str(other)) == before


def test_a_regular_file_and_a_folder_below_one_are_refused(src, env, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    line = mk.refused(src, str(afile), env, tmp_path)
    assert line == f"spill: error: {afile} is a file; move to a new or empty folder"
    line = mk.refused(src, f"{afile}/sub", env, tmp_path)
    assert line == (
        f"spill: error: {afile}/sub lies under {afile}, which is a file; move to a new or empty "
        "folder"
    )
    assert afile.read_text() == "mine\n"


def test_ftp_is_refused_before_any_connection(src, env, tmp_path):
    line = mk.refused(src, "ftp://host/x", env, tmp_path)
    assert line == (
        "spill: error: ftp://host/x: unsupported location (ftp:// is not a store spill keeps runs "
        "on); use a local path, s3://, gs://, az:// or memory://"
    )


def test_a_256_byte_segment_is_refused_before_anything_changes(src, env, tmp_path):
    to = f"{tmp_path}/{'a' * 256}"
    line = mk.refused(src, to, env, tmp_path)
    assert line == (
        f"spill: error: {to}: {'a' * 24}...{'a' * 16} is 256 bytes long, and this file system "
        "takes at most 255; move to a shorter path"
    )


def test_a_destination_too_deep_for_the_snapshot_is_refused_before_anything_changes(
    src, env, tmp_path
):
    left, segments = 4095 - 40 - len(f"{tmp_path}/"), []  # 40 bytes short of PATH_MAX
    while left > 1:  # the folder fits; every file of the state is deeper than 40 bytes
        segments.append("b" * min(200, left - 1))
        left -= len(segments[-1]) + 1
    to = f"{tmp_path}/" + "/".join(segments)
    assert 4095 - 42 <= len(to) <= 4095 - 40
    line = mk.refused(src, to, env, tmp_path)
    assert line.startswith(f"spill: error: {to}: "), line
    assert line.endswith(
        " bytes long there, longer than this file system takes; move to a shorter path"
    ), line
    assert not (tmp_path / ("b" * 200)).exists(), "the probe left its folders"


def test_a_file_uri_is_the_local_path_it_names(control, src, env, tmp_path):
    dst = tmp_path / "dst"
    line = mk.refused(src, f"file://{src}/sub", env, tmp_path, code=2)
    assert line.endswith(f"{src}/sub and {src} overlap; move to a location outside the project")
    moved = json.loads(
        mk.ok(mk.spill("move", src, f"file://{dst}", "--json", env=env, cwd=tmp_path)).stdout
    )
    assert moved["to"] == str(dst) and moved["status"] == "active"
    assert not (tmp_path / "file:").exists()
    shown = mk.ok(mk.spill("status", f"file://{dst}", env=env, cwd=tmp_path)).stdout
    assert "moved here from " in shown
    built = mk.ok(mk.spill("build", f"file://{dst}", env=env, cwd=tmp_path))
    assert f"== tune: continue at step {mk.STOP} of {mk.STEPS}" in built.stderr, built.stderr
    mk.assert_same(mk.outcome(str(dst)), control)


def test_state_and_resume_take_a_file_uri(tmp_path, env):
    proj = mk.project(tmp_path / "proj")
    state = tmp_path / "elsewhere"
    mk.ok(
        mk.spill(
            "build",
            str(proj),
            "--state",
            f"file://{state}",
            "--stop-after",
            "tune:2",
            env=env,
            cwd=tmp_path,
        )
    )
    assert (state / "runs" / "current.json").is_file() and not (tmp_path / "file:").exists()
    resumed = mk.ok(
        mk.spill("resume", f"file://{state}", "--stop-after", "tune:4", env=env, cwd=tmp_path)
    )
    assert f"at {state}: " in resumed.stderr and not (tmp_path / "file:").exists()
    assert mk.doc(str(proj)) is None and os.path.isdir(state / "stages")


def test_a_source_whose_run_list_was_deleted_still_moves(src, env, tmp_path, control):
    """The control objects are the authority: the mover rebuilds the lost ``runs/current.json``
    as a build would, and the moved run finishes as an uninterrupted build does."""
    os.unlink(Path(src) / ".spill" / "runs" / "current.json")
    dst = tmp_path / "dst"
    mk.ok(mk.spill("move", src, str(dst), env=env, cwd=tmp_path))
    mk.ok(mk.spill("build", str(dst), env=env, cwd=tmp_path))
    mk.assert_same(mk.outcome(str(dst)), control)
