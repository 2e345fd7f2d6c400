"""Issue 11's evidence for ``spill move`` with real processes and real signals.

* Drills: a real ``spill move`` SIGKILLed right after its destination claim and after each of
  its seven steps (``SPILL_DRILL=move-claim``, ``move-<step>``). Before the rerun, ``spill
  status`` says which step the move is at and no place is acquirable: ``spill build`` at the
  source and at the destination both refuse and change nothing (after the claim alone the
  source is untouched; after ``activate`` the destination is the one place, and its build runs).
  The same ``spill move`` then finishes the same transfer (after the claim: adopting it); ``spill build`` at the destination ends equal to an
  uninterrupted build of the project (``move_kit.assert_same``: every stage, the checkpoint, the
  adapter, byte for byte), and the source refuses with "moved to <dest> at ...".
  Local -> local in the default run; local -> S3 and S3 -> local (the moto server over HTTP) under
  ``slow``; one S3 round trip (a stopped build moved to S3, finished there, its complete run
  copied back) in the default run.
* A race: a live ``spill build`` against ``spill move``: without ``--wait`` the move exits 75
  naming the writer and changes nothing; with ``--wait`` the writer stops at a committed
  boundary (exit 75) and the move finishes, while a poller reading both control objects never
  sees the destination past its claim beside a source that is not quiescing or transferred,
  nor an active destination beside a source that is not transferred. The writer
  is paused in its tune (SIGSTOP) and continued once the move waits, in the default run; a
  free-running long tune with ``--lease 3`` under ``slow``.
* Engines: a build stopped on torch, moved, finished on MLX with another ``SPILL_HOME``.
* Bad input: refused file systems and backends, a destination that is not empty or inside the
  source, a project without a run, an installed copy: one line, non-zero, nothing changed at
  the source and nothing written at the destination (more: tests/func/test_move_places.py;
  aborts, races for one destination and a full disk: tests/func/test_move_abort.py).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import signal
import socket
import time
from pathlib import Path

import pytest

from spill.control.owner import home_of
from spill.control.transfer import describe_move
from spill.store.location import location
from tests.conftest import bucket_uri
from tests.func import authority_kit as ak
from tests.func import move_kit as mk
from tests.func import tune_kit as kit

HOST = socket.gethostname()
SLOW = pytest.mark.slow
WHERE = ["local"] + [
    pytest.param(f"{way}-{store}", marks=SLOW)
    for store in ("s3", "gs", "az")
    for way in ("to", "from")
]


@pytest.fixture
def control(tmp_path_factory) -> dict:
    return mk.control(tmp_path_factory)


places = mk.places


# --- 1. SIGKILL after each step, then the same move ----------------------------------------------


N = {"claim": 0, **{s: i + 1 for i, s in enumerate(mk.MOVE_STEPS)}}
CLAIM_AT_DST = {
    0: "claim",
    1: "claim",
    2: "claim",
    3: "take",
    4: "take",
    5: "incoming",
    6: "incoming",
}


def _check_refusals(src: str, dst: str, step: str, env: dict, cwd: Path) -> None:
    """After the kill: the source refuses (after the claim alone it is untouched), and so does
    the destination (until ``activate``)."""
    n = N[step]
    rid = mk.doc(src)["run"]
    before = mk.tree(mk.state_of(src))
    if n >= 1:
        at_src = mk.spill("build", src, env=env, cwd=cwd)
        assert at_src.returncode == 1 and not mk.ran_a_stage(at_src), at_src.stderr
        last = mk.last_line(at_src.stderr)
        if n <= 5:
            assert f"spill: error: run {rid} at " in last, last
            assert last.endswith(
                f" is being moved to {dst} (step {step} done); run the same `spill move` again "
                "to finish it, or `spill move --abort` to call it off"
            ), last
        else:
            assert last.startswith(f"spill: error: run {rid} moved to {dst} at "), last
            assert last.endswith("; continue there"), last
        assert mk.tree(mk.state_of(src)) == before, "a refused build changed the source"

    before = mk.tree(dst)
    at_dst = mk.spill("build", dst, env=env, cwd=cwd)
    if step == "activate":  # the move's last write landed: the destination is the one place
        mk.ok(at_dst)
        return
    assert at_dst.returncode != 0 and not mk.ran_a_stage(at_dst), at_dst.stderr
    if n >= 3:  # the files are there (a project's spill.yaml): the claim says where they come from
        src_home = home_of(location(mk.state_of(src)))
        claim = CLAIM_AT_DST[n]
        assert f"is arriving from {src_home} (a move, step {claim})" in at_dst.stderr
    assert mk.tree(dst) == before, "a refused build changed the destination"


def _check_status(src: str, dst: str, step: str, env: dict, cwd: Path) -> None:
    n = N[step]
    shown = mk.ok(mk.spill("status", src, env=env, cwd=cwd)).stdout
    if n == 0:  # the source is untouched (from S3: it says where it was moved from)
        assert "move: moving" not in shown, shown
    elif n <= 5:
        assert f"move: moving to {dst}: step {n} of 7 ({step}) done" in shown, shown
    else:
        assert f"move: moved to {dst} at " in shown, shown
    if n <= 6:
        src_home = home_of(location(mk.state_of(src)))
        claim = CLAIM_AT_DST[n]
        said = f"moving from {src_home}: step {N[claim]} of 7 ({claim}) done"
        assert describe_move(mk.doc(dst)) == said  # what `spill status` says there
        if n >= 3:  # the project's files are there: its status says it too
            there = mk.ok(mk.spill("status", dst, env=env, cwd=cwd)).stdout
            assert f"move: {said}" in there, there


def _sources_left(src: str, dst: str, step: str, first: dict) -> dict:
    """The control objects the killed mover left, checked against the step it reached
    (``first``: the source's control object before the move)."""
    n, gen = N[step], first["generation"]
    left = mk.doc(src)
    there = mk.doc(dst)  # claimed as incoming before the source changed
    assert there["status"] == ("incoming" if n <= 6 else "active")
    assert there["transfer"]["step"] == CLAIM_AT_DST.get(n, "activate")
    if n == 0:  # the source is untouched
        assert left == first
        return there
    t = left["transfer"]
    assert t["to"] == dst and t["from"] == home_of(location(mk.state_of(src)))
    assert t["step"] == (step if n <= 6 else "fence")
    assert left["status"] == ("quiescing" if n <= 5 else "transferred")
    assert left["generation"] == (gen if n == 1 else gen + 1)  # the mover takes the next one
    assert there["transfer"]["id"] == t["id"]
    return left


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("step", ["claim", *mk.MOVE_STEPS])
def test_sigkill_after_each_move_step_then_the_same_move_finishes(
    control, tmp_path, tmp_path_factory, request, where, step
):
    src, dst, env = places(where, tmp_path, tmp_path_factory, request)
    argv = ("move", src, dst, "--json")
    first = mk.doc(src)
    killed = mk.spill(*argv, env=env, cwd=tmp_path, drill=f"move-{step}")
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-3000:])
    left = _sources_left(src, dst, step, first)
    _check_status(src, dst, step, env, tmp_path)
    _check_refusals(src, dst, step, env, tmp_path)

    again = mk.ok(mk.spill(*argv, env=env, cwd=tmp_path))
    result = json.loads(again.stdout)
    assert result["to"] == dst and result["transfer"] == left["transfer"]["id"]
    assert result["status"] == ("complete" if step == "activate" else "active")
    src_doc, dst_doc = mk.doc(src), mk.doc(dst)
    assert src_doc["status"] == "transferred" and src_doc["transfer"]["id"] == result["transfer"]
    assert dst_doc["transfer"]["id"] == result["transfer"]
    assert dst_doc["home"] == home_of(location(mk.state_of(dst)))
    assert not [r for r in mk.tree(dst) if r.rsplit("/", 1)[-1].startswith(".move-")]

    final = mk.ok(mk.spill("build", dst, env=env, cwd=tmp_path))
    if step != "activate":  # (there the probe's build finished it)
        assert f"== tune: continue at step {mk.STOP} of {mk.STEPS}" in final.stderr, final.stderr
    mk.assert_same(mk.outcome(dst), control)
    refused = mk.spill("build", src, env=env, cwd=tmp_path)
    assert refused.returncode == 1 and not mk.ran_a_stage(refused), refused.stderr
    assert f"moved to {dst} at " in mk.last_line(refused.stderr)


# --- 2. one round trip through each object store in the default run --------------------------------


@pytest.mark.parametrize("store", ["s3", "gs", pytest.param("az", marks=SLOW)])
def test_a_run_moved_to_a_bucket_finishes_there_and_its_complete_run_copies_back(
    control, tmp_path, tmp_path_factory, request, store
):
    bucket = bucket_uri(request, store)
    env = mk.env_for(tmp_path / "home")
    src = str(mk.copy_of_stopped(tmp_path_factory, tmp_path / "src"))
    s3, back = f"{bucket}/toy", str(tmp_path / "back")
    there = json.loads(mk.ok(mk.spill("move", src, s3, "--json", env=env, cwd=tmp_path)).stdout)
    assert there["status"] == "active" and there["to"] == s3
    built = mk.ok(mk.spill("build", s3, env=env, cwd=tmp_path))
    assert f"== tune: continue at step {mk.STOP} of {mk.STEPS}" in built.stderr, built.stderr
    mk.assert_same(mk.outcome(s3), control)
    refused = mk.spill("build", src, env=env, cwd=tmp_path)
    assert refused.returncode == 1 and f"moved to {s3} at " in mk.last_line(refused.stderr)

    finished = mk.tree(mk.state_of(s3))
    home = mk.doc(s3)
    copied = json.loads(mk.ok(mk.spill("move", s3, back, "--json", env=env, cwd=tmp_path)).stdout)
    assert copied["status"] == "complete" and copied["to"] == back
    assert mk.tree(mk.state_of(s3)) == finished, "a complete run is read-only: copied, not moved"
    mine = mk.doc(back)
    assert mine["status"] == "complete" and mine["home"] == home_of(location(mk.state_of(back)))
    assert mine["lineage"]["copied_from"] == home["home"] == mk.state_of(s3)
    again = mk.ok(mk.spill("build", back, env=env, cwd=tmp_path))
    assert not mk.ran_a_stage(again), again.stderr
    mk.assert_same(mk.outcome(back), control)


# --- 3. a live writer against the move --------------------------------------------------------------

RACE_STEPS, RACE_EVERY = 300, 5


def _writer(how: str, src: Path, env: dict) -> kit.Worker:
    """A live ``spill build`` inside its tune stage with a committed checkpoint: paused there
    (SIGSTOP at the third step, the default lease), or running a long tune (``--lease 3``)."""
    if how == "paused":
        return ak.paused(["build", str(src)], env, "tune-before-forward@3", str(src / ".spill"))
    writer = kit.Worker(["build", str(src), "--lease", "3"], env)
    assert writer.wait_for("== tune"), writer.finish().stderr
    while not glob.glob(str(src / ".spill/stages/tune/payloads/ckpt-*/COMMIT")):
        assert writer.proc.poll() is None
        time.sleep(0.005)
    return writer


@pytest.mark.parametrize("how", ["paused", pytest.param("running", marks=SLOW)])
def test_a_live_writer_stops_for_the_move_and_two_places_are_never_acquirable(
    tmp_path, tmp_path_factory, how
):
    steps, every = (mk.STEPS, mk.EVERY) if how == "paused" else (RACE_STEPS, RACE_EVERY)
    want = mk.control(tmp_path_factory, steps, every)
    src = mk.project(tmp_path / "src", steps, every)
    dst = tmp_path / "dst"
    env = mk.env_for(tmp_path / "home")
    writer = _writer(how, src, env)
    poller = mk.Poller(str(src), str(dst))
    try:
        refused = mk.spill("move", str(src), str(dst), env=env, cwd=tmp_path)
        assert refused.returncode == 75, refused.stderr
        last = mk.last_line(refused.stderr)
        assert f"is held by {HOST} pid {writer.proc.pid} since " in last, last
        assert "add --wait to stop it at its next committed boundary" in last, last
        d = mk.doc(str(src))
        assert (d["status"], d.get("transfer"), d["generation"]) == ("active", None, 1)
        assert d["owner"]["pid"] == writer.proc.pid and not dst.exists()

        poller.start()
        mover = kit.Worker(["move", str(src), str(dst), "--wait", "--json"], env)
        if how == "paused":  # the mover quiesced the run and waits: let the writer go on
            while mk.doc(str(src))["status"] != "quiescing":
                assert mover.proc.poll() is None, mover.finish().stderr
                time.sleep(0.01)
            writer.proc.send_signal(signal.SIGCONT)
        moved = mover.finish()
        stopped = writer.finish()
    finally:
        writer.proc.send_signal(signal.SIGCONT)
        if writer.proc.poll() is None:
            writer.proc.kill()
        poller.halt.set()
    poller.join()
    mk.ok(moved)
    assert stopped.returncode == 75, stopped.stderr[-3000:]
    assert f"build preempted by a move to {dst}; committed: tune at step " in stopped.stderr
    assert "adapter written" not in stopped.stderr
    assert not poller.bad, poller.bad
    assert ("incoming", "quiescing") in poller.seen
    assert poller.seen[-1] == ("active", "transferred")
    committed = mk.doc(str(dst))["pointers"]["stages/tune/ckpt"]
    step = max(mk.payload_seq(c) for c in committed)
    # the writer stops at the first step boundary after it sees the quiesce, with a checkpoint
    # there: a ckpt_every step when it saw it at a publication, any step when its heartbeat saw
    # it first (a writer paused past its heartbeat's interval reads the control object at once)
    assert 0 < step < steps

    final = mk.ok(mk.spill("build", str(dst), env=env, cwd=tmp_path))
    assert f"== tune: continue at step {step} of {steps}" in final.stderr, final.stderr
    mk.assert_same(mk.outcome(str(dst)), want)
    again = mk.spill("build", str(src), env=env, cwd=tmp_path)
    assert again.returncode == 1 and f"moved to {dst} at " in mk.last_line(again.stderr)
    print(f"\nrace ({how}): the writer stopped at step {step}; the poller saw {poller.seen}")


# --- 4. a move between engines ----------------------------------------------------------------------


def _has_mlx() -> bool:
    try:
        return importlib.util.find_spec("mlx.core") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.mlx
@pytest.mark.skipif(not _has_mlx(), reason="mlx.core is not installed (pip install mlx[cpu])")
def test_a_run_stopped_on_torch_moves_and_finishes_on_mlx_on_another_home(
    control, tmp_path, tmp_path_factory
):
    src = str(mk.copy_of_stopped(tmp_path_factory, tmp_path / "src"))
    dst = str(tmp_path / "dst")
    mk.ok(mk.spill("move", src, dst, env=mk.env_for(tmp_path / "home"), cwd=tmp_path))
    elsewhere = mk.env_for(tmp_path / "home2")  # a second machine: its own SPILL_HOME
    built = mk.ok(mk.spill("build", dst, "engine=mlx", env=elsewhere, cwd=tmp_path))
    assert f"== tune: continue at step {mk.STOP} of {mk.STEPS}" in built.stderr, built.stderr
    tune_row = [r for r in built.stdout.splitlines() if r.split()[:2] == ["tune", "done"]]
    assert len(tune_row) == 1 and "torch float32" in tune_row[0] and "mlx float32" in tune_row[0]
    assert f"{mk.STEPS} of {mk.STEPS} steps" in tune_row[0] and " done " in tune_row[0]

    got = mk.outcome(dst)
    assert got["stages"]["tune"]["status"] == "done"
    assert got["stages"]["tune"]["engines"] == ["torch", "mlx"]
    state = mk.tune_state(got)
    ranges = [(p["from_step"], p["to_step"], p["engine"]) for p in state["producers"]]
    assert ranges == [(0, mk.STOP, "torch"), (mk.STOP, mk.STEPS, "mlx")]
    assert state["step"] == len(state["losses"]) == mk.STEPS  # no step missing or repeated
    assert state["cursor"] == mk.tune_state(control)["cursor"]
    # the steps before the move are torch's own, exactly
    assert state["losses"][: mk.STOP] == mk.tune_state(control)["losses"][: mk.STOP]


# --- 5. bad input -----------------------------------------------------------------------------------


BAD = [
    ("/proc/spill-move", "is on a proc file system, where locks are not reliable"),
    ("/sys/spill-move", "is on a sysfs file system, where locks are not reliable"),
    ("foo://bucket/p", "unsupported location (foo:// is not a store spill keeps runs on)"),
    ("ftp://host/x", "unsupported location (ftp:// is not a store spill keeps runs on)"),
]


@pytest.mark.parametrize("to, says", BAD, ids=["proc", "sys", "unknown-scheme", "ftp"])
def test_a_move_to_a_refused_file_system_or_backend_changes_nothing(
    tmp_path, tmp_path_factory, to, says
):
    src = str(mk.copy_of_stopped(tmp_path_factory, tmp_path / "src"))
    line = mk.refused(src, to, mk.env_for(tmp_path / "home"), tmp_path)
    assert says in line, line


@pytest.mark.parametrize("inside", ["sub", ".spill/x", ".."])
def test_a_destination_overlapping_the_source_is_refused(tmp_path, tmp_path_factory, inside):
    src = mk.copy_of_stopped(tmp_path_factory, tmp_path / "src")
    to = str((src / inside).resolve()) if inside == ".." else str(src / inside)
    line = mk.refused(str(src), to, mk.env_for(tmp_path / "home"), tmp_path, code=2)
    assert line.endswith("overlap; move to a location outside the project"), line


def test_a_project_without_a_run_is_refused(tmp_path):
    src = mk.project(tmp_path / "src")
    line = mk.refused(str(src), str(tmp_path / "dst"), mk.env_for(tmp_path / "home"), tmp_path)
    assert line == f"spill: error: nothing to move at {src}/.spill: it holds no run"
    assert mk.doc(str(src)) is None and not (tmp_path / "dst").exists()


def test_an_installed_copy_is_refused(tmp_path, tmp_path_factory):
    from spill.control.keys import CURRENT, RUNS
    from spill.control.ownership import as_copy

    src = mk.copy_of_stopped(tmp_path_factory, tmp_path / "src")
    state = str(src / ".spill")
    copy, runs = as_copy(mk.doc(str(src)), location(state))
    (src / ".spill" / RUNS / copy["run"] / "control.json").write_text(json.dumps(copy))
    (src / ".spill" / RUNS / CURRENT).write_text(json.dumps(runs))
    line = mk.refused(str(src), str(tmp_path / "dst"), mk.env_for(tmp_path / "home"), tmp_path)
    assert f"run {copy['run']} at {state} is an installed copy; move the original" in line, line
    assert "`spill build --new-run`" in line
    assert not (tmp_path / "dst").exists()


def test_a_destination_that_is_not_empty_is_refused_before_anything_changes(
    tmp_path, tmp_path_factory
):
    src = str(mk.copy_of_stopped(tmp_path_factory, tmp_path / "src"))
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine\n")
    line = mk.refused(src, str(full), mk.env_for(tmp_path / "home"), tmp_path)
    assert (
        line
        == f"spill: error: {full} is not empty (notes.txt, ...); move to a new or empty location"
    )
    assert mk.tree(str(full)) == {"notes.txt": b"mine\n"}


def test_a_move_to_memory_is_refused(tmp_path, tmp_path_factory):
    src = str(mk.copy_of_stopped(tmp_path_factory, tmp_path / "src"))
    to = "memory://spill-move/p"
    line = mk.refused(src, to, mk.env_for(tmp_path / "home"), tmp_path, code=2)
    assert line == (
        f"spill: error: {to}: memory:// lives only inside one process; move to a folder or an "
        "object store"
    )


def test_a_move_to_a_missing_bucket_changes_nothing_and_names_the_bucket(
    tmp_path, tmp_path_factory, s3_bucket
):
    src = str(mk.copy_of_stopped(tmp_path_factory, tmp_path / "src"))
    bucket = f"{s3_bucket}-missing"
    line = mk.refused(src, f"s3://{bucket}/p", mk.env_for(tmp_path / "home"), tmp_path)
    assert line == (
        f"spill: error: s3://{bucket}/p/.spill: bucket {bucket!r} does not exist (or these "
        "credentials cannot see it); create it, or fix the URI"
    )
