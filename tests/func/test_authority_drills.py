"""Issue 10's evidence with real ``spill tune`` and ``spill build`` processes: one writer per run.

* A stale owner: a tune paused (SIGSTOP) past its lease is taken over by the same command; the
  successor finishes equal to the uninterrupted control, and the old process, continued, fails
  with the "taken over by" line naming the successor, having changed nothing that is current.
* SIGKILL right after every control transition (acquire, renew, publish, complete): the same
  command with the default lease (120 s) continues at once, since the dead owner is provably gone
  on this host, and ends equal to the control; after ``complete`` it answers from the run.
* A state copied while its owner is alive cannot continue that run until the original is released.
* A second ``spill build`` exits 75 naming the owner; with ``--wait`` it waits and finds the build
  finished.

"Equal to the control" is ``tune_kit``'s check: the final checkpoint (every tensor, the losses,
the cursor, the COMMIT bytes) and the adapter tree, byte for byte.

CI runs the local cases (about 40 s of CPU) and one publication on GCS; ``-m slow``
adds the S3, GCS and Azure variants of the rest and the other publications: ``pytest -q -m slow tests/func/test_authority_drills.py``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import time

import pytest

from tests.conftest import bucket_uri
from tests.func import authority_kit as ak
from tests.func import tune_kit as kit
from tests.func.test_build import copy_toy

STEPS = kit.STEPS
HOST = socket.gethostname()


@pytest.fixture(scope="module")
def control(tmp_path_factory, tiny_models) -> kit.Control:
    return kit.control(tmp_path_factory, tiny_models)


def assert_equals_control(state: str, control: kit.Control) -> None:
    kit.assert_same_checkpoint(state, control.state)
    assert kit.adapter_files(state) == kit.adapter_files(control.state)


def state_at(where: str, tmp_path, request) -> str:
    """A fresh state location: a local folder, or a prefix in a fresh bucket of the S3, GCS or
    Azure server (``where``: s3, gs, az)."""
    if where == "local":
        return str(tmp_path / "state")
    return f"{bucket_uri(request, where)}/job"


# every object store, slow (one tune each); gs has its fast case in the transitions
STORES = [pytest.param(w, marks=pytest.mark.slow) for w in ("s3", "gs", "az")]


# --- 1. a stale owner --------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["local", *STORES])
def test_a_stale_owner_is_taken_over_and_fails_when_it_continues(control, tmp_path, request, where):
    state = state_at(where, tmp_path, request)
    env = kit.spill_env(tmp_path / "home")
    argv = kit.tune_argv(control.model, control.train, state, ckpt_every=1, lease=1.5)
    old = ak.paused(argv, env, "tune-before-forward@4", state)  # steps 1-3 committed
    try:
        stale = ak.wait_past_lease(state)
        assert stale["generation"] == 1 and stale["owner"]["pid"] == old.proc.pid
        committed = kit.latest_step(state)
        assert committed >= 3  # (more only if ak.paused had to let it run on past a renewal)

        new = kit.run_tune(argv, env)
        assert new.returncode == 0, new.stderr
        assert kit.resumed_from(new.stderr) == committed
        after = ak.doc(state)
        assert after["generation"] == 2 and after["status"] == "complete"
        assert after["owner"]["pid"] != old.proc.pid
        assert after["owner"]["since"] > stale["lease"]["expires"]
    finally:
        old.proc.send_signal(signal.SIGCONT)
    done = old.finish()
    assert done.returncode not in (0, 75), done.stderr
    last = ak.last_line(done.stderr)
    taken = f"was taken over by {HOST} pid {after['owner']['pid']} (generation 2)"
    assert last.startswith(f"spill: error: run {after['run']} {taken}"), done.stderr
    assert "adapter written" not in done.stderr

    # nothing of the old process became current: the document is the successor's, unchanged
    assert ak.doc(state) == after
    for name in ak.pointed(after):
        gen, seq = ak.gen_seq(name)
        assert gen == 2 or seq <= committed, name
    late = [n for n in ak.payloads(state) if ak.gen_seq(n)[0] == 1 and ak.gen_seq(n)[1] > committed]
    print(f"\nstale owner ({where}): exit {done.returncode}; late payloads, not pointed at: {late}")
    assert_equals_control(state, control)


# --- 2. SIGKILL right after each control transition ---------------------------------------------

# (drill, --lease of the killed run, the step committed after the kill: None for nothing, "any"
# for whatever was; where). Saves fall at steps 2, 4, 6 (--ckpt-every 2), one publication each.
# The heartbeat renews at a third of the lease: 3 s puts the first renewal inside the run and
# leaves its lease live long after the kill, so only the dead-owner rule can let the rerun in.
# The rerun has the default lease (120 s) whatever the killed run had.
SLOW = pytest.mark.slow
TRANSITIONS = [
    pytest.param("control-acquire", None, None, "local", id="control-acquire"),
    pytest.param("control-renew", 3.0, "any", "local", id="control-renew"),
    pytest.param("control-publish@1", None, 2, "local", id="control-publish@1", marks=SLOW),
    pytest.param("control-publish@2", None, 4, "local", id="control-publish@2"),
    pytest.param("control-publish@3", None, 6, "local", id="control-publish@3", marks=SLOW),
    pytest.param("control-complete", None, 6, "local", id="control-complete"),
    pytest.param("control-publish@2", None, 4, "s3", id="control-publish@2-s3", marks=SLOW),
    pytest.param("control-complete", None, 6, "s3", id="control-complete-s3", marks=SLOW),
    pytest.param("control-acquire", None, None, "gs", id="control-acquire-gs", marks=SLOW),
    pytest.param("control-publish@2", None, 4, "gs", id="control-publish@2-gs"),
    pytest.param("control-complete", None, 6, "gs", id="control-complete-gs", marks=SLOW),
    pytest.param("control-acquire", None, None, "az", id="control-acquire-az", marks=SLOW),
    pytest.param("control-publish@2", None, 4, "az", id="control-publish@2-az", marks=SLOW),
    pytest.param("control-complete", None, 6, "az", id="control-complete-az", marks=SLOW),
]


@pytest.mark.parametrize("drill, lease, committed, where", TRANSITIONS)
def test_sigkill_after_a_control_transition_then_the_rerun_continues_at_once(
    control, tmp_path, request, drill, lease, committed, where
):
    state = state_at(where, tmp_path, request)
    env = kit.spill_env(tmp_path / "home")
    argv = kit.tune_argv(control.model, control.train, state)
    killed = kit.run_tune(
        [*argv, *(["--lease", str(lease)] if lease else [])], {**env, "SPILL_DRILL": drill}
    )
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-3000:])
    dead = ak.doc(state)
    assert dead["generation"] == 1
    assert dead["owner"]["released"] == (drill == "control-complete")
    if committed == "any":
        committed = kit.latest_step(state)
    assert kit.latest_step(state) == committed

    again = kit.run_tune(argv, env)  # the same command, the default lease of 120 s
    assert again.returncode == 0, again.stderr
    assert kit.resumed_from(again.stderr) == committed
    assert_equals_control(state, control)
    now = ak.doc(state)
    assert now["status"] == "complete"
    if drill == "control-complete":  # the completed run answered; nothing of it changed
        assert now == dead
        return
    assert now["generation"] == 2 and now["owner"]["pid"] != dead["owner"]["pid"]
    # it came in while the dead owner's lease was live: the dead-owner rule, not the lease
    assert now["owner"]["since"] < dead["lease"]["expires"]
    print(
        f"\n{drill}: committed {committed}; lease left at takeover "
        f"{dead['lease']['expires'] - now['owner']['since']:.1f} s; left {kit.litter(state)}"
    )


# --- 3. a copied state ---------------------------------------------------------------------------


def copy_state(src: str, dst: str) -> None:
    """Copy a state location file by file, as a user would (``cp -r``, ``aws s3 cp``)."""
    if kit.fs.is_local(src):
        shutil.copytree(src, dst)
        return
    fs, path = kit.fs.filesystem(src)
    fs.copy(path, kit.fs.filesystem(dst)[1], recursive=True)


def home(state: str) -> str:
    return f"{HOST}:{os.path.realpath(state)}" if kit.fs.is_local(state) else state


@pytest.mark.parametrize("where", ["local", *STORES])
def test_a_copy_cannot_continue_the_run_while_the_original_is_held(
    control, tmp_path, request, where
):
    original = state_at(where, tmp_path, request)
    copy = original[: -len("state")] + "copy" if where == "local" else original + "-copy"
    env = kit.spill_env(tmp_path / "home")
    argv = kit.tune_argv(control.model, control.train, original)  # the default lease
    owner = ak.paused(argv, env, "tune-before-forward@3", original)  # step 2 committed
    try:
        copy_state(original, copy)
        committed = kit.latest_step(copy)
        assert committed >= 2
        on_copy = kit.tune_argv(control.model, control.train, copy)
        refused = kit.run_tune(on_copy, env)
        assert refused.returncode == 75, refused.stderr
        last = ak.last_line(refused.stderr)
        held = f"at {original} is held by {HOST} pid {owner.proc.pid} since "
        assert last.startswith("spill: error: run ") and held in last, last
        shown = os.path.realpath(copy) if where == "local" else copy
        assert f"(this state at {shown} is a copy of it)" in last, last
        assert ak.doc(copy)["generation"] == 1  # the refusal wrote nothing
    finally:
        owner.proc.send_signal(signal.SIGCONT)
    assert owner.finish().returncode == 0
    assert ak.doc(original)["status"] == "complete"

    again = kit.run_tune(on_copy, env)  # released: the copy may continue its own way
    assert again.returncode == 0, again.stderr
    assert kit.resumed_from(again.stderr) == committed
    assert_equals_control(copy, control)
    mine = ak.doc(copy)
    assert mine["generation"] == 2 and mine["status"] == "complete"
    assert mine["lineage"]["copied_from"] == home(original)
    assert mine["home"] == home(copy)


# --- 4. a second build ---------------------------------------------------------------------------

FAST = ["tune.steps=8", "tune.ckpt_every=4"]


def _asleep(pid: int) -> bool:
    """Whether ``pid`` sleeps in ``time.sleep`` (acquire's poll); True where Linux cannot say."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            where = f.read()
    except OSError:
        return True
    return where in ("", "0") or "nanosleep" in where


def test_a_second_build_exits_75_naming_the_owner_and_with_wait_finds_it_finished(tmp_path):
    project = copy_toy(tmp_path / "toy")
    state = str(project / ".spill")
    env = kit.spill_env(tmp_path / "home")
    argv = ["build", str(project), *FAST]
    first = ak.paused(argv, env, "tune-before-forward@3", state)  # inside tune, lease live
    waiter = None
    try:
        second = kit.run_tune(argv, env)
        assert second.returncode == 75, second.stderr
        last = ak.last_line(second.stderr)
        run = ak.doc(state)["run"]
        held = f"spill: error: run {run} at {state} is held by {HOST} pid {first.proc.pid} since "
        assert last.startswith(held), last
        status = kit.run_tune(["status", str(project)], env)
        assert status.returncode == 0, status.stderr
        assert f"owner {HOST} pid {first.proc.pid} since " in status.stdout, status.stdout

        waiter = kit.Worker([*argv, "--wait"], env)
        while not _asleep(waiter.proc.pid):  # polling the run, not yet its owner
            assert waiter.proc.poll() is None
            time.sleep(0.05)
    finally:
        first.proc.send_signal(signal.SIGCONT)
    done = first.finish()
    assert done.returncode == 0, done.stderr
    assert "== tune" in done.stderr
    waited = waiter.finish()
    assert waited.returncode == 0, waited.stderr
    assert "== " not in waited.stderr  # no stage ran again
    assert re.search(r"tune\s+done", waited.stdout), waited.stdout
