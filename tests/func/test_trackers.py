"""``tune.log`` / ``--log``: TensorBoard and MLflow through the real CLI, read back with their
own readers (TensorBoard's ``EventAccumulator``, ``MlflowClient`` against a real ``mlflow
server`` on loopback, and local stores).

The promise checked every time: each committed step 1..N is in each tracker exactly once, its
train loss the checkpoint state's (MLflow exactly; TensorBoard as the float32 it stores), its
learning rate the schedule's, whether the run went straight through, was stopped and resumed,
or was SIGKILLed (at named points: after a commit before its log, between the two trackers,
after the last commit; and at random moments) and rerun until it finished.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from spill.jobs.schedule import cosine_lr
from tests.conftest import run_spill
from tests.func import tune_kit as kit
from tests.servers import start_mlflow, stop_mlflow

pytest.importorskip("tensorboard", reason="tensorboard is in the test extra")
pytest.importorskip("mlflow", reason="mlflow is in the test extra")

STEPS = kit.STEPS
LR = kit.SETTINGS["lr"]


@pytest.fixture(scope="module")
def mlflow_url(tmp_path_factory):
    """A real ``mlflow server`` (SQLite store) on 127.0.0.1 for the module."""
    root = tmp_path_factory.mktemp("mlflow-server")
    with open(root / "server.log", "wb") as log:
        try:
            proc, url = start_mlflow(str(root / "store"), log)
        except RuntimeError as e:
            pytest.fail(f"{e}: {(root / 'server.log').read_text()[-2000:]}")
    yield url
    stop_mlflow(proc)


@pytest.fixture(scope="module")
def control(tmp_path_factory, tiny_models) -> kit.Control:
    return kit.control(tmp_path_factory, tiny_models)


def tune(control, state: Path, name: str, kinds: str, **over) -> list[str]:
    argv = kit.tune_argv(control.model, control.train, str(state), **over)
    argv[argv.index("--name") + 1] = name  # the experiment: one per test
    return [*argv, "--log", kinds]


def tensorboard(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def mlflow_runs(uri: str, experiment: str) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment} at {uri}"
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def mlflow_metrics(uri: str, run) -> dict[str, list[tuple[int, float]]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    history = {k: client.get_metric_history(run.info.run_id, k) for k in run.data.metrics}
    return {k: [(m.step, m.value) for m in ms] for k, ms in history.items()}


def assert_each_step_once(got: dict, losses: list[float], float32: bool) -> None:
    """Steps 1..N once each in train/loss and train/lr, with the state's values; tokens/s at
    most once a step (a step computed by a killed process that never logged it has none)."""
    want = [float(np.float32(x)) for x in losses] if float32 else losses
    loss = sorted(got["train/loss"])
    assert [s for s, _ in loss] == list(range(1, STEPS + 1)), loss
    assert [v for _, v in loss] == want
    lr = sorted(got["train/lr"])
    assert [s for s, _ in lr] == list(range(1, STEPS + 1)), lr
    expected = [cosine_lr(s - 1, LR, 0, STEPS) for s in range(1, STEPS + 1)]
    assert [v for _, v in lr] == pytest.approx(expected, rel=1e-6)
    assert lr[0][1] == pytest.approx(LR)  # step 1 applied the full rate (no warmup)
    rates = [s for s, _ in got.get("train/tokens_per_s", [])]
    assert len(rates) == len(set(rates)) and set(rates) <= set(range(1, STEPS + 1))


def check_both(tmp_path, url: str, name: str, control, tokens: tuple | list | None = None) -> None:
    """Both trackers hold each step once; ``tokens``: the steps with tokens/s in each (a list:
    any one of these)."""
    logged = tensorboard(tmp_path / "state" / "tensorboard")
    assert_each_step_once(logged, control.losses, float32=True)
    (run,) = mlflow_runs(url, name)
    metrics = mlflow_metrics(url, run)
    assert_each_step_once(metrics, control.losses, float32=False)
    assert run.info.status == "FINISHED"
    assert run.data.params["tune.lr"] == str(LR) and run.data.params["seed"] == "3"
    assert run.data.tags["spill.engine"] == "torch" and run.data.tags["spill.machine"]
    if tokens is not None:
        got = tuple({s for s, _ in x["train/tokens_per_s"]} for x in (logged, metrics))
        assert got in (tokens if isinstance(tokens, list) else [tokens]), got


def test_a_run_stopped_and_resumed_logs_each_step_once_to_both(control, tmp_path, mlflow_url):
    env = kit.spill_env(tmp_path / "home", MLFLOW_TRACKING_URI=mlflow_url)
    state = tmp_path / "state"
    argv = tune(control, state, "resumed", "tensorboard,mlflow")
    first = kit.run_tune([*argv, "--stop-after", "3"], env)
    assert first.returncode == 0, first.stderr
    assert f"logging to tensorboard {state / 'tensorboard'}, mlflow {mlflow_url}" in first.stderr
    (run,) = mlflow_runs(mlflow_url, "resumed")
    assert run.info.status == "KILLED"  # a leg that stops early
    again = kit.run_tune(argv, env)
    assert again.returncode == 0, again.stderr
    every = set(range(1, STEPS + 1))
    check_both(tmp_path, mlflow_url, "resumed", control, (every, every))
    done = kit.run_tune(argv, env)  # finished: nothing new anywhere
    assert done.returncode == 0 and "run complete" in done.stderr, done.stderr
    check_both(tmp_path, mlflow_url, "resumed", control)
    assert kit.state_json(str(state), STEPS)["losses"] == control.losses  # logging changed nothing


# (the drills of the legs before the one that finishes; the steps with tokens/s in TensorBoard
# and in MLflow: a step back-filled from the state has none)
# (the first case covers both kinds of kill; the others are slow: -m slow)
SLOW = pytest.mark.slow
ALL = {1, 2, 3, 4, 5, 6}
KILLS = [
    # killed after step 4's commit, before its log; then after one tracker's write while
    # back-filling 3 and 4: the next leg back-fills the other from the state
    (["ckpt-after-commit@2", "track-logged@1"], ({1, 2, 5, 6}, {1, 2, 5, 6})),
    # killed after the first tracker's write at step 4's commit (each has its own thread: either
    # may be first, or the other may have written too): the one that lacks 3 and 4 back-fills
    pytest.param(
        ["track-logged@3"], [(ALL, {1, 2, 5, 6}), ({1, 2, 5, 6}, ALL), (ALL, ALL)], marks=SLOW
    ),
    # the last commit made, nothing of it logged: the rerun has no step to run, only back-fills
    pytest.param(["ckpt-after-commit@3"], ({1, 2, 3, 4}, {1, 2, 3, 4}), marks=SLOW),
]
IDS = ["ckpt-after-commit@2+track-logged@1", "track-logged@3", "ckpt-after-commit@3"]


@pytest.mark.parametrize("drills, tokens", KILLS, ids=IDS)
def test_sigkill_between_commit_and_log_then_rerun(control, tmp_path, mlflow_url, drills, tokens):
    env = kit.spill_env(tmp_path / "home", MLFLOW_TRACKING_URI=mlflow_url)
    name = "kill-" + "-".join(d.replace("@", "") for d in drills)
    argv = tune(control, tmp_path / "state", name, "tensorboard,mlflow")
    for drill in drills:
        killed = kit.run_tune(argv, {**env, "SPILL_DRILL": drill})
        assert killed.returncode == -9, (drill, killed.stderr[-3000:])
    done = kit.run_tune(argv, env)
    assert done.returncode == 0, done.stderr
    check_both(tmp_path, mlflow_url, name, control, tokens)


@pytest.mark.slow
def test_sigkill_at_random_moments_then_each_step_once(control, tmp_path, mlflow_url):
    """Five legs SIGKILLed at seeded random moments after the model loaded, then a finishing
    one: both trackers hold each step once, with the uninterrupted control's losses."""
    env = kit.spill_env(tmp_path / "home", MLFLOW_TRACKING_URI=mlflow_url)
    argv = tune(control, tmp_path / "state", "random-kills", "tensorboard,mlflow")
    rng = random.Random(24)
    killed = 0
    for _ in range(5):
        w = kit.Worker(argv, env)
        if w.wait_for(kit.PRE_RUN):
            # over the control's own timeline (pre-run line to adapter), plus opening MLflow
            time.sleep(rng.uniform(0.0, control.window + 1.0))
            if w.proc.poll() is None:
                w.proc.kill()  # the child we started, by its pid
        killed += w.finish().returncode == -9
    assert killed >= 2, killed  # most legs died mid-run
    done = kit.run_tune(argv, env)
    assert done.returncode == 0, done.stderr
    check_both(tmp_path, mlflow_url, "random-kills", control)


@pytest.mark.parametrize("store", [pytest.param(x, marks=SLOW) for x in ("sqlite", "file")])
def test_a_local_mlflow_store(control, tmp_path, store, monkeypatch):
    """MLflow without a server: a local SQLite database, and the file store (MLflow 3 keeps it
    behind ``MLFLOW_ALLOW_FILE_STORE``)."""
    uri = (
        f"sqlite:///{tmp_path / 'mlflow.db'}" if store == "sqlite" else f"file://{tmp_path}/mlruns"
    )
    extra = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_ALLOW_FILE_STORE": "true"}
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the reader here too
    env = kit.spill_env(tmp_path / "home", **extra)
    argv = tune(control, tmp_path / "state", "local", "mlflow")
    first = kit.run_tune([*argv, "--stop-after", "2"], env)
    assert first.returncode == 0, first.stderr
    again = kit.run_tune(argv, env)
    assert again.returncode == 0, again.stderr
    (run,) = mlflow_runs(uri, "local")
    assert_each_step_once(mlflow_metrics(uri, run), control.losses, float32=False)
    assert not (tmp_path / "state" / "tensorboard").exists()  # only what --log names


def test_an_unknown_or_missing_tracker_is_one_line_before_the_model_loads(control, tmp_path):
    env = kit.spill_env(tmp_path / "home")
    argv = kit.tune_argv(control.model, control.train, str(tmp_path / "state"))
    bad = kit.run_tune([*argv, "--log", "tensorboard,wandb"], env)
    assert bad.returncode == 2 and "'wandb' is not a tracker spill logs to" in bad.stderr
    shadow = tmp_path / "shadow" / "mlflow"  # an mlflow that cannot be imported
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed here')\n")
    path = f"{shadow.parent}:{env.get('PYTHONPATH', '')}"
    missing = kit.run_tune([*argv, "--log", "mlflow"], {**env, "PYTHONPATH": path})
    assert missing.returncode == 1, missing.stderr
    lines = missing.stderr.strip().splitlines()
    assert lines == [
        "spill: error: logging to mlflow needs its package: pip install "
        "'streamweights[mlflow]' (or drop mlflow from --log / tune.log)"
    ], lines
    assert not (tmp_path / "state" / "payloads").exists()


@pytest.mark.slow
def test_spill_eval_logs_its_scores(control, tmp_path, mlflow_url):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"id": i, "prompt": f"{i} plus {i}?", "answer": f" {2 * i}"}) + "\n"
            for i in range(3)
        )
    )
    env = kit.spill_env(tmp_path / "home", MLFLOW_TRACKING_URI=mlflow_url)
    argv = ["eval", str(control.model), str(rows), "--state", str(tmp_path / "ev"), "--json"]
    argv += ["--dtype", "float32", "--log", "mlflow,tensorboard"]
    for _ in range(2):  # the same eval again logs nothing twice
        done = run_spill(*argv, base=env, timeout=kit.TIMEOUT)
        assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    runs = [
        r for r in mlflow_runs(mlflow_url, "spill-eval") if r.info.run_name.endswith("rows.jsonl")
    ]
    (run,) = runs
    metrics = mlflow_metrics(mlflow_url, run)
    assert metrics["eval/rows"] == [(0, 3.0)]
    assert metrics["eval/gold_logprob"] == [(0, result["gold_logprob"])]
    assert tensorboard(tmp_path / "ev" / "tensorboard")["eval/rows"] == [(0, 3.0)]


@pytest.mark.slow
def test_a_sweep_is_sibling_runs_of_one_experiment(tmp_path, mlflow_url):
    import shutil

    toy = tmp_path / "toy"
    shutil.copytree(kit_root() / "projects" / "toy", toy, ignore=shutil.ignore_patterns(".spill"))
    env = {"MLFLOW_TRACKING_URI": mlflow_url, "SPILL_HOME": str(tmp_path / "home")}
    fast = ["tune.steps=4", "tune.ckpt_every=2", "tune.log=[mlflow,tensorboard]"]
    proc = run_spill("build", str(toy), "-m", *fast, "tune.lr=0.005,0.01", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    runs = mlflow_runs(mlflow_url, "toy")
    assert sorted(r.data.params["tune.lr"] for r in runs) == ["0.005", "0.01"]
    for r in runs:
        lr = r.data.params["tune.lr"]
        assert (
            r.info.run_name.endswith(f"tune.lr={lr}")
            and f"tune.lr={lr}" in r.data.params["overrides"]
        )
        assert r.data.tags["spill.overrides"] == r.data.params["overrides"]
        metrics = mlflow_metrics(mlflow_url, r)
        assert sorted(s for s, _ in metrics["train/loss"]) == [1, 2, 3, 4]
        assert [s for s, _ in metrics["eval/accuracy"]] == [4]  # the tuned adapter, at its step
        assert [s for s, _ in metrics["eval_base/accuracy"]] == [0]
        assert r.info.status == "FINISHED"
        logged = tensorboard(toy / ".spill" / "tensorboard" / r.info.run_name)
        assert sorted(s for s, _ in logged["train/loss"]) == [1, 2, 3, 4]
    again = run_spill("build", str(toy), "-m", *fast, "tune.lr=0.005,0.01", "--json", env=env)
    assert again.returncode == 0, again.stderr
    assert len(mlflow_runs(mlflow_url, "toy")) == 2  # the same sweep again: the same two runs


# --- trackers that fail: never a step's wait, one line each (issue 35, items 14 and 24) ------


def _one_line_error(done, elapsed: float, bound: float) -> str:
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    [line] = [ln for ln in done.stderr.splitlines() if ln.startswith("spill: error:")]
    assert elapsed < bound, (elapsed, done.stderr)  # MLflow's own defaults: 250 s, 900 s
    return line


def test_an_mlflow_port_that_refuses_is_one_line_in_seconds(control, tmp_path):
    """Nothing listens at the tracking URI's port (a socket bound, then closed): the open is
    refused in one line within seconds, not after MLflow's 4 minutes of retries."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    env = kit.spill_env(tmp_path / "home", MLFLOW_TRACKING_URI=url)
    t0 = time.monotonic()
    done = kit.run_tune(tune(control, tmp_path / "state", "refused", "mlflow"), env)
    line = _one_line_error(done, time.monotonic() - t0, 90)
    assert line.startswith(f"spill: error: MLflow at {url}: ") and "MLFLOW_TRACKING_URI" in line
    assert kit.committed_steps(str(tmp_path / "state")) == []  # no step ran


@pytest.mark.slow  # ~40 s: MLflow's read timeout (10 s) three times
def test_an_mlflow_server_that_never_answers_is_one_line_in_bounded_time(control, tmp_path):
    """A port that accepts connections and never reads them: the open gives up after three
    read timeouts (~30 s), in one line, instead of waiting 120 s per try, eight tries."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)  # the kernel accepts; nothing ever reads or answers
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        env = kit.spill_env(tmp_path / "home", MLFLOW_TRACKING_URI=url)
        t0 = time.monotonic()
        done = kit.run_tune(tune(control, tmp_path / "state", "silent", "mlflow"), env)
        line = _one_line_error(done, time.monotonic() - t0, 120)
    assert "timed out" in line or "Timeout" in line, line
    assert kit.committed_steps(str(tmp_path / "state")) == []


@pytest.mark.slow  # an mlflow server of its own (~20 s to start), and up to 30 s of flush
@pytest.mark.parametrize("how", ["dies", "stops-answering"])
def test_an_mlflow_server_lost_mid_run_never_holds_a_step(control, tmp_path, how):
    """The server is SIGKILLed (refuses from then on) or SIGSTOPped (accepts, never answers)
    right after the run's first commit was logged: every later step runs at its pace (the
    steps after it land while the logging waits), the run finishes, and the loss is said in
    exactly one warning line; TensorBoard beside it still holds every step."""
    root = tmp_path / "server"
    root.mkdir()
    with open(root / "server.log", "wb") as log:
        proc, url = start_mlflow(str(root / "store"), log)
    try:
        env = kit.spill_env(tmp_path / "home", MLFLOW_TRACKING_URI=url)
        lines = {**env, "SPILL_PROGRESS": "lines", "SPILL_PROGRESS_EVERY": "0"}  # a line a step
        steps = 30
        argv = tune(control, tmp_path / "state", how, "tensorboard,mlflow", steps=steps)
        t0 = time.monotonic()
        w = kit.Worker(argv, lines)
        assert w.wait_for("tune: step 3/")  # past step 2's commit, logged to MLflow
        assert len(_wait_runs(url, how)) == 1
        os.killpg(proc.pid, signal.SIGKILL if how == "dies" else signal.SIGSTOP)
        lost = time.monotonic()
        assert w.wait_for(f"tune: step {steps}/")
        steps_after = time.monotonic() - lost
        done = w.finish()
        elapsed = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGCONT)
        stop_mlflow(proc)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    warned = [ln for ln in done.stderr.splitlines() if ln.startswith("warning: logging to mlflow")]
    assert len(warned) == 1, done.stderr
    # MLflow's own client held each step for up to 4 (dies) or 16 minutes (stops answering);
    # here the 27 steps after the loss take their own time, and the end waits 30 s at most
    assert steps_after < 60, (steps_after, done.stderr)
    assert elapsed < 180, (elapsed, done.stderr)
    got = tensorboard(tmp_path / "state" / "tensorboard")
    assert sorted(s for s, _ in got["train/loss"]) == list(range(1, steps + 1))


def _wait_runs(url: str, experiment: str, within: float = 30) -> list:
    deadline = time.monotonic() + within
    while True:
        try:
            return mlflow_runs(url, experiment)
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_read_only_tensorboard_folder_is_one_warning_and_no_traceback(control, tmp_path):
    """The state's TensorBoard folder exists, read-only (root: the run without the capability
    that overrides permission bits): the run finishes, one warning line says it, and no writer
    thread prints a traceback; the folder stays empty."""
    board = tmp_path / "state" / "tensorboard"
    board.mkdir(parents=True)
    board.chmod(0o555)
    env = kit.spill_env(tmp_path / "home")
    argv = tune(control, tmp_path / "state", "read-only", "tensorboard")
    drop = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search"]
    if os.geteuid() == 0 and not shutil.which("setpriv"):
        pytest.skip("root writes into read-only folders, and setpriv is not here to drop that")
    command = [*drop, sys.executable, "-m", "spill"] if os.geteuid() == 0 else None
    try:
        if command is None:
            done = kit.run_tune(argv, env)
        else:
            w = kit.Worker(argv, env, command=command)
            done = w.finish()
    finally:
        board.chmod(0o755)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "Exception in thread" not in done.stderr, done.stderr
    warned = [ln for ln in done.stderr.splitlines() if "warning:" in ln]
    assert len(warned) == 1 and "logging to tensorboard failed" in warned[0], done.stderr
    assert "Permission denied" in warned[0], warned
    assert list(board.iterdir()) == []
    assert kit.committed_steps(str(tmp_path / "state"))[-1] == STEPS


def kit_root() -> Path:
    return Path(__file__).resolve().parents[2]


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


@pytest.mark.slow  # (CI's time budget; tests/func/test_valid.py covers the values themselves)
def test_the_validation_loss_is_logged_at_its_steps_once(control, tmp_path, mlflow_url):
    """``--valid``: ``valid/loss`` at every --eval-every step, the committed values, once each
    across a stop and a resume (stopped at 3: step 2's value was committed, step 4's not)."""
    env = kit.spill_env(tmp_path / "home", MLFLOW_TRACKING_URI=mlflow_url)
    state = tmp_path / "state"
    valid = kit.write_train(tmp_path / "valid.jsonl", n=5, salt="v")
    argv = tune(control, state, "validated", "tensorboard,mlflow", valid=valid, eval_every=2)
    assert kit.run_tune([*argv, "--stop-after", "3"], env).returncode == 0
    done = kit.run_tune(argv, env)
    assert done.returncode == 0, done.stderr
    want = kit.state_json(str(state), STEPS)["valid"]
    assert [s for s, _ in want] == [2, 4, 6]
    logged = tensorboard(state / "tensorboard")["valid/loss"]
    assert sorted(logged) == [(s, float(np.float32(x))) for s, x in want]
    (run,) = mlflow_runs(mlflow_url, "validated")
    assert sorted(mlflow_metrics(mlflow_url, run)["valid/loss"]) == [tuple(p) for p in want]
