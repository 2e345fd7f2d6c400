"""Kill drills for ``spill tune``: real ``python -m spill tune`` processes are SIGKILLed or
SIGTERMed mid-run, then the same command runs again in a fresh process until it finishes.

The promise checked every time: the final checkpoint equals the uninterrupted control's exactly
(every adapter and AdamW tensor, the losses, the cursor, the COMMIT bytes and so the sha256 of
every file), the adapter tree is the control's byte for byte, the rerun restarted from the last
committed step (its ``continuing ... step k`` line names the newest checkpoint that verifies
after the kill, and that checkpoint lies on the control's trajectory), no step is lost or
repeated (six losses, the control's), and nothing a dead writer left survives the next save
(no checkpoint folder the run does not point at, no temporary file anywhere under the state).
A checkpoint is current only while the run's control object points at it, so "committed" below
means published: a folder with a COMMIT that the pointer does not name is litter.

Kills come three ways: at each named boundary (``SPILL_DRILL=<boundary>@k``: the process
SIGKILLs itself there), at 20 random moments (a seeded RNG; the parent sends SIGKILL, two cases
at a time) drawn over the start-up, steps, saves and adapter publication and anchored on the
run's own progress, and at the COMMIT boundary on an S3 state.
SIGTERM is sent by the parent: once while the process is paused right after a step's backward
pass (the step finishes, is committed, exit 75), once at an arbitrary moment, and once during a
long step with a short grace, which the job abandons: the previous step is committed from the
watchdog thread and the process exits 75 without waiting for the step.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.func import tune_kit as kit

STEPS = kit.STEPS


@pytest.fixture(scope="module")
def control(tmp_path_factory, tiny_models) -> kit.Control:
    return kit.control(tmp_path_factory, tiny_models)


def assert_killed(proc) -> None:
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-3000:])


def assert_on_track(state: str, control: kit.Control, step: int | None) -> None:
    """The checkpoint a kill left is a prefix of the control run (exact where the control kept it)."""
    if step is None:
        return
    assert kit.state_json(state, step)["losses"] == control.losses[:step]
    if step in kit.committed_steps(control.state):
        kit.assert_same_checkpoint(state, control.state, step)


def finish(state: str, control: kit.Control, env: dict, committed: int | None, **over) -> str:
    """Rerun the command in a fresh process to the end; check it against the control."""
    done = kit.run_tune(kit.tune_argv(control.model, control.train, state, **over), env)
    assert done.returncode == 0, done.stderr
    assert kit.resumed_from(done.stderr) == committed
    kit.assert_same_checkpoint(state, control.state)
    assert kit.adapter_files(state) == kit.adapter_files(control.state)
    left = kit.litter(state)
    if committed != STEPS:
        assert left == []  # the rerun saved: nothing a dead writer left survives a save
    else:
        # the rerun had no step to save, so no save cleaned up; the only thing a kill after the
        # last publication can leave is an older folder the collection had not removed (yet)
        assert all(x.endswith("(not current)") and f"-s{STEPS}-" not in x for x in left), left
        if left:
            print(f"left after a rerun with nothing to save: {left}")
    return done.stderr


# --- every named boundary -----------------------------------------------------------------------

# (drill, the step whose checkpoint verifies after the kill, what the kill must have left)
# Saves fall at steps 2, 4 and 6 (--ckpt-every 2); a local save writes its three files in place
# (nobody trusts them before COMMIT) and puts COMMIT atomically, so put 1 is step 2's COMMIT, 2
# step 4's, 3 step 6's and 4 on the adapter's (control objects are written without drill
# counting). The killed run is generation 1, so its folders are
# ``payloads/ckpt-g1-s<step>-0``.
BOUNDARIES = [
    ("tune-before-forward@4", 2, []),
    ("tune-after-backward@4", 2, []),
    ("tune-after-optimizer@4", 2, []),  # step 4 applied in memory, its checkpoint not yet due
    ("tune-after-optimizer@2", None, []),  # before the first checkpoint: the rerun starts fresh
    ("ckpt-between-files@2", 2, ["payloads/ckpt-g1-s4-0 (not current)"]),
    ("ckpt-before-commit@2", 2, ["payloads/ckpt-g1-s4-0 (not current)"]),
    ("ckpt-after-commit@2", 4, []),  # published; step 2 is still the second one kept
    # the last checkpoint published, step 2 not yet collected: the rerun only publishes
    ("ckpt-after-commit@3", 6, ["payloads/ckpt-g1-s2-0 (not current)"]),
    (
        "put-before-rename@2",
        2,
        ["payloads/ckpt-g1-s4-0 (not current)", "payloads/ckpt-g1-s4-0/.COMMIT.tmp-"],
    ),
    ("put-before-rename@5", 6, ["adapter/"]),  # killed while publishing the adapter
]


@pytest.mark.parametrize("drill, committed, left", BOUNDARIES, ids=[b[0] for b in BOUNDARIES])
def test_sigkill_at_a_named_boundary_then_rerun_equals_the_control(
    control, tmp_path, drill, committed, left
):
    state = str(tmp_path / "state")
    env = kit.spill_env(tmp_path / "home")
    killed = kit.run_tune(
        kit.tune_argv(control.model, control.train, state), {**env, "SPILL_DRILL": drill}
    )
    assert_killed(killed)
    assert "adapter written" not in killed.stderr
    assert kit.latest_step(state) == committed
    assert_on_track(state, control, committed)
    found = kit.litter(state)
    assert len(found) == len(left) and all(
        any(f.startswith(prefix) for f in found) for prefix in left
    ), found
    finish(state, control, env, committed)


def test_sigkill_before_commit_on_s3_then_rerun_equals_the_control(control, s3_bucket, tmp_path):
    state = f"s3://{s3_bucket}/job"
    env = kit.spill_env(tmp_path / "home")  # carries AWS_ENDPOINT_URL and the test credentials
    argv = kit.tune_argv(control.model, control.train, state)
    killed = kit.run_tune(argv, {**env, "SPILL_DRILL": "ckpt-before-commit@2"})
    assert_killed(killed)
    # step 4's three files are on the server, its COMMIT is not: a reader trusts step 2
    [four] = kit.step_folders(state, 4)
    assert kit.fs.listdir(four) == ["opt.safetensors", "params.safetensors", "state.json"]
    assert kit.latest_step(state) == 2
    assert kit.litter(state) == ["payloads/ckpt-g1-s4-0 (not current)"]
    assert_on_track(state, control, 2)
    finish(state, control, env, 2)
    assert kit.committed_steps(state) == [4, 6]


# --- random moments -----------------------------------------------------------------------------

RANDOM_KILLS = 20
_rng = random.Random(20250917)
# (where, anchor pick, fraction, --ckpt-every of the killed run, of the rerun, and for every fifth
# case the fraction of half the window at which the rerun is killed too).
#
# "steps" (14 cases): the anchor is the progress bar's first frame or the moment a save creates
# its step directory, picked at random; the kill follows after a random fraction of what the
# control took from that point to the next one (a save and the steps up to the next save, or the
# adapter's publication after the last). Anchoring on the run's own progress keeps the kills in
# the steps and saves even when the machine is busy; those take about a fifth of a run, the rest
# is start-up and publication. "run" (6 cases): anchored on the pre-run line, drawn over the
# whole window up to "adapter written".
MOMENTS = [
    (
        "steps" if i % 10 < 7 else "run",
        _rng.random(),
        _rng.random(),
        (1, 2, 3)[i % 3],
        (2, 3, 1)[i % 3],
        _rng.random() if i % 5 == 4 else None,
    )
    for i in range(RANDOM_KILLS)
]
# Two cases run side by side (one process each on this 2-core machine), which halves the time.
PAIRS = [(i, i + RANDOM_KILLS // 2) for i in range(RANDOM_KILLS // 2)]


def _label(i: int) -> str:
    where, _, fraction, every, _, again_at = MOMENTS[i]
    return f"{i}-{where}-{fraction:.2f}-every-{every}" + ("-twice" if again_at is not None else "")


def _moment(control: kit.Control, state: str, i: int) -> tuple[str, Callable, float]:
    """Case ``i``'s kill: what to wait for (described, and as a function of the worker) and the
    delay after it."""
    where, pick, fraction, every, _, _ = MOMENTS[i]
    if where == "run":
        return "the pre-run line", lambda w: True, fraction * control.window
    saves = list(range(every, STEPS + 1, every))
    k = int(pick * (len(saves) + 1))
    if k == 0:
        # the control's first COMMIT came after 2 steps; this run's after ``every``
        span = control.first + (every - kit.SETTINGS["ckpt_every"]) * control.step
        return "the progress bar", lambda w: w.wait_for(kit.BAR), fraction * max(span, 0.0)
    n = saves[k - 1]
    span = every * control.step if n < STEPS else control.publish

    def created(w: kit.Worker) -> bool:
        while not kit.step_folders(state, n):
            if w.proc.poll() is not None:
                return False
            time.sleep(0.0005)
        return True

    return f"the folder of step {n} appeared", created, fraction * span


def _kill_at(argv: list[str], env: dict, wait: Callable, delay: float):
    """Start a run; once its pre-run line is out and ``wait(worker)`` returns, wait ``delay``
    seconds and SIGKILL it."""
    w = kit.Worker(argv, {**env, "SPILL_PROGRESS": "1"})
    if w.wait_for(kit.PRE_RUN) and wait(w):
        time.sleep(delay)
        w.proc.send_signal(signal.SIGKILL)
    return w.finish()


def _random_kill(control: kit.Control, base, i: int) -> None:
    """Kill once (or twice: the rerun too) at case ``i``'s moment, then finish with another
    --ckpt-every (not part of the run's identity) and compare with the control."""
    _, _, _, every, every_after, again_at = MOMENTS[i]
    env = kit.spill_env(base / "home")
    # The delays come from the control's timings; under other load a run can finish before its
    # kill lands. Such a try tested nothing: try again on a fresh state with half the delay.
    for attempt in range(5):
        state = str(base / f"state-{attempt}")
        anchor, wait, delay = _moment(control, state, i)
        delay *= 0.5**attempt
        argv = kit.tune_argv(control.model, control.train, state, ckpt_every=every)
        killed = _kill_at(argv, env, wait, delay)
        if killed.returncode != 0:
            break
    assert_killed(killed)
    committed = kit.latest_step(state)
    note = (
        f"case {i}: SIGKILL {delay:.3f} s after {anchor}: committed {committed}, "
        f"left {kit.litter(state)}, adapter files {len(kit.adapter_files(state))}"
    )
    assert_on_track(state, control, committed)
    if again_at is not None:
        # the rerun has less to do: draw over the first half of the window
        again = _kill_at(argv, env, lambda w: True, again_at * control.window / 2)
        # a rerun with little left to do may be done first; that is fine too
        assert again.returncode in (0, -signal.SIGKILL), again.stderr
        assert kit.resumed_from(again.stderr) == committed
        committed = kit.latest_step(state)
        note += f"; SIGKILL the rerun: exit {again.returncode}, committed {committed}"
        assert_on_track(state, control, committed)
    print(note)
    finish(state, control, env, committed, ckpt_every=every_after)


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{_label(a)}+{_label(b)}" for a, b in PAIRS])
def test_sigkill_at_random_moments_then_rerun_equals_the_control(control, tmp_path, pair):
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {i: pool.submit(_random_kill, control, tmp_path / f"case-{i}", i) for i in pair}
    for i, run in runs.items():
        try:
            run.result()
        except Exception as e:
            raise AssertionError(f"random kill case {_label(i)} failed") from e


# --- SIGTERM ----------------------------------------------------------------------------------

PREEMPTED = re.compile(r"spill: preempted by SIGTERM after [\d.]+ s; (.*)committed: step (\d+)")


def _paused(argv: list[str], env: dict, drill: str) -> kit.Worker:
    """A run that stopped itself (SIGSTOP) at ``drill``."""
    w = kit.Worker(argv, {**env, "SPILL_DRILL": f"{drill}:stop"})
    _, status = os.waitpid(w.proc.pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status), status
    return w


def _term(w: kit.Worker, resume: bool) -> float:
    """SIGTERM (and SIGCONT a paused run); seconds from the signal to the exit."""
    t0 = time.monotonic()
    w.proc.send_signal(signal.SIGTERM)
    if resume:
        w.proc.send_signal(signal.SIGCONT)
    w.proc.wait(timeout=60)
    return time.monotonic() - t0


def _preempted(proc, state: str, control: kit.Control) -> int:
    assert proc.returncode == 75, (proc.returncode, proc.stderr[-3000:])
    lines = PREEMPTED.findall(proc.stderr)
    assert len(lines) == 1, proc.stderr
    step = int(lines[0][1])
    assert kit.latest_step(state) == step
    assert len(kit.state_json(state, step)["losses"]) == step
    assert_on_track(state, control, step)
    assert "adapter" not in kit.fs.listdir(state)
    return step


def test_sigterm_after_a_backward_pass_finishes_the_step_commits_and_exits_75(control, tmp_path):
    """Paused after step 5's backward pass, then SIGTERM: step 5 is applied and committed."""
    state = str(tmp_path / "state")
    env = kit.spill_env(tmp_path / "home")
    argv = kit.tune_argv(control.model, control.train, state, ckpt_every=4)
    w = _paused(argv, env, "tune-after-backward@5")
    seconds = _term(w, resume=True)
    proc = w.finish()
    assert _preempted(proc, state, control) == 5
    assert "committed: step 5 (committed)" in proc.stderr  # a new checkpoint, not step 4's
    assert "abandoned" not in proc.stderr
    print(f"\nSIGTERM after a backward pass: exit 75 {seconds:.2f} s after the signal")
    finish(state, control, env, 5)


def test_sigterm_at_an_arbitrary_moment_commits_and_the_rerun_equals_the_control(control, tmp_path):
    """SIGTERM at a moment of the parent's choosing, while steps run (after the first COMMIT)."""
    state = str(tmp_path / "state")
    env = kit.spill_env(tmp_path / "home")
    w = kit.Worker(kit.tune_argv(control.model, control.train, state, ckpt_every=1), env)
    deadline = time.monotonic() + 60
    while not kit.commit_landed(state, 1) and time.monotonic() < deadline and w.proc.poll() is None:
        time.sleep(0.002)
    time.sleep(random.Random(7).random() * 0.03)  # well within the five steps left
    seconds = _term(w, resume=False)
    proc = w.finish()
    step = _preempted(proc, state, control)
    assert 1 <= step < STEPS
    print(f"\nSIGTERM at step {step}: exit 75 {seconds:.2f} s after the signal")
    finish(state, control, env, step)


def test_sigterm_during_a_long_step_abandons_it_and_commits_the_previous(tmp_path, tiny_models):
    """A step of 32 micro-batches (about 0.6 s here) outlasts a 0.1 s grace: the watchdog commits
    step 1 and exits.

    Its own control (batch 64 is part of the run's identity) runs the two steps uninterrupted.
    """
    model = tiny_models["llama"]
    train = kit.write_train(tmp_path / "train.jsonl")
    long = {"steps": 2, "batch": 64, "micro_batch": 2, "ckpt_every": 2}
    env = kit.spill_env(tmp_path / "home", SPILL_PREEMPT_DEADLINE="20")
    ref = str(tmp_path / "control")
    done = kit.run_tune(kit.tune_argv(model, train, ref, **long), env)
    assert done.returncode == 0, done.stderr

    state = str(tmp_path / "state")
    argv = kit.tune_argv(model, train, state, **long)
    w = _paused(argv, {**env, "SPILL_PREEMPT_GRACE": "0.1"}, "tune-before-forward@2")
    seconds = _term(w, resume=True)
    proc = w.finish()
    assert proc.returncode == 75, proc.stderr
    assert "the step in progress was abandoned after 0.1 s" in proc.stderr
    assert "committed: step 1 (committed)" in proc.stderr
    assert kit.latest_step(state) == 1 and kit.litter(state) == []
    assert len(kit.state_json(state, 1)["losses"]) == 1
    print(f"\nSIGTERM during a long step: exit 75 {seconds:.2f} s after the signal (grace 0.1 s)")

    again = kit.run_tune(argv, env)
    assert again.returncode == 0, again.stderr
    assert kit.resumed_from(again.stderr, steps=2, accum=32) == 1
    kit.assert_same_checkpoint(state, ref, step=2, accum=32)
    assert kit.adapter_files(state) == kit.adapter_files(ref)
