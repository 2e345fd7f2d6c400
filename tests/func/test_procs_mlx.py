"""One job over several MLX processes started by MLX's own launcher, ``mlx.launch`` (its ring
backend on loopback), the ranks exchanging through ``mx.distributed``: two ranks write what one
MLX process writes, bit for bit; a stop of one rank stops both at one step and one process
continues to the uninterrupted bits; a rank SIGKILLed or stopped (SIGSTOP) ends the other with
``GroupLost``'s line, exit 75; a row job's file is one process's.

mlx.launch exits 0 whatever its ranks did; it names each rank that did not (``Node with rank 0
exited with code 75``), which is what these tests read.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.func import tune_kit as kit
from tests.func.test_procs import SHORT, ranges, rows_argv, same_run

pytestmark = pytest.mark.mlx

MLX = {**SHORT, "engine": "mlx", "dropout": 0}
MLX_LONG = {**MLX, "steps": 30, "ckpt_every": 5}
LAUNCH = Path(sys.executable).with_name("mlx.launch")
LINES = {"SPILL_PROGRESS": "lines", "SPILL_PROGRESS_EVERY": "0"}  # a line a step
GROUP_TIMEOUT = 15  # seconds a collective may wait for a silent rank (the SIGSTOP drill)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_models):
    pytest.importorskip("mlx.core", reason="the MLX engine is not installed")
    if not LAUNCH.exists():
        pytest.skip(f"no mlx.launch next to {sys.executable}")
    root = tmp_path_factory.mktemp("procs-mlx")
    return {"model": tiny_models["llama"], "train": kit.write_train(root / "train.jsonl")}


@pytest.fixture(scope="module")
def controls(inputs, tmp_path_factory):
    """The uninterrupted one-MLX-process runs of MLX and MLX_LONG."""
    root = tmp_path_factory.mktemp("procs-mlx-control")
    env = kit.spill_env(root / "home")
    out = {}
    for name, settings in (("short", MLX), ("long", MLX_LONG)):
        done = kit.run_tune(argv(inputs, root / name, settings), env)
        assert done.returncode == 0, done.stderr
        out[name] = str(root / name)
    return out


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("procs-mlx-rows")
    prompts, graded = root / "prompts.jsonl", root / "test.jsonl"
    ask = [{"id": i, "prompt": f"Question {i}: what is {i} plus 3?"} for i in range(13)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ask))
    graded.write_text("".join(json.dumps(r | {"answer": f" {r['id'] + 3}."}) + "\n" for r in ask))
    return {"prompts": prompts, "test": graded}


def argv(inputs, state, settings, **over) -> list[str]:
    return kit.tune_argv(inputs["model"], inputs["train"], str(state), **{**settings, **over})


def ports() -> int:
    """A port ``p`` with ``p + 1`` free too: the ring listens on one per rank."""
    for _ in range(100):
        base = random.randrange(20000, 60000)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise AssertionError("no two free ports in a row")


def launcher(n: int) -> list[str]:
    """``mlx.launch`` on this host, starting ``python -m spill`` ``n`` times."""
    return [str(LAUNCH), "-n", str(n), "--backend", "ring", "-p", str(ports()),
            "--python", sys.executable, "--", "-m", "spill"]  # fmt: skip


def launch(n: int, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return kit.Worker(args, env, command=launcher(n)).finish()


def exited(stderr: str, rank: int) -> int:
    """A rank's exit code as mlx.launch reports it (it says nothing of a rank that exited 0)."""
    for line in stderr.splitlines():
        if f"Node with rank {rank} exited with code " in line:
            return int(line.split("exited with code ")[1].split()[0])
    return 0


def rank_pid(w: kit.Worker, rank: int) -> int:
    import psutil

    for child in psutil.Process(w.proc.pid).children(recursive=True):
        if child.environ().get("MLX_RANK") == str(rank):
            return child.pid
    raise AssertionError(f"no rank {rank} under mlx.launch")


def test_two_ranks_write_what_one_mlx_process_writes(inputs, controls, tmp_path):
    state = tmp_path / "state"
    done = launch(2, argv(inputs, state, MLX), kit.spill_env(tmp_path / "home"))
    assert (exited(done.stderr, 0), exited(done.stderr, 1)) == (0, 0), done.stderr
    assert "· 2 processes, each its own ring and --memory" in done.stderr
    assert done.stderr.count("adapter written to") == 1  # rank 0 speaks for the job
    assert ranges(same_run(str(state), controls["short"], 4)) == [(0, 4, 2)]
    assert (
        kit.adapter_files(str(state))["params.safetensors"]
        == kit.adapter_files(controls["short"])["params.safetensors"]
    )


def test_a_stop_at_two_ranks_continues_as_one_process(inputs, controls, tmp_path):
    """SIGTERM to rank 1 alone: both ranks stop at one step, rank 0 commits (75); one MLX process
    then finishes with the uninterrupted run's bits."""
    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    w = kit.Worker(argv(inputs, state, MLX_LONG), {**env, **LINES}, command=launcher(2))
    assert w.wait_for("tune: step 6/")
    os.kill(rank_pid(w, 1), signal.SIGTERM)
    leg = w.finish()
    assert (exited(leg.stderr, 0), exited(leg.stderr, 1)) == (75, 75), leg.stderr
    assert leg.stderr.count("preempted by a stop of another process of this job") == 1
    assert "again" not in leg.stderr  # mlx.launch stopping rank 0 after rank 1 is no news
    stopped = kit.committed_steps(str(state))[-1]
    assert 6 <= stopped < MLX_LONG["steps"]
    leg = kit.run_tune(argv(inputs, state, MLX_LONG), env)
    assert leg.returncode == 0, leg.stderr
    got = ranges(same_run(str(state), controls["long"], MLX_LONG["steps"]))
    assert got == [(0, stopped, 2), (stopped, MLX_LONG["steps"], 1)]


@pytest.mark.parametrize("how", ["SIGKILL", "SIGSTOP"])
def test_a_lost_rank_ends_the_other_with_one_line(inputs, controls, tmp_path, how):
    """Rank 1 SIGKILLed (its socket closes: the ring fails the collective at once) or SIGSTOPped
    (nothing closes: the group's watchdog ends rank 0 after SPILL_GROUP_TIMEOUT): rank 0 exits 75
    with GroupLost's line, and the same command at two ranks finishes the run's bits."""
    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    # The timeout bounds every collective from the ranks' join on, not only the one after the
    # SIGSTOP: on a busy 2-core machine a rank may lag the other by seconds (loading the model,
    # or descheduled inside a step), and 3 s ended rank 0 there before step 7, with this line.
    lines = {**env, **LINES, "SPILL_GROUP_TIMEOUT": str(GROUP_TIMEOUT)}
    w = kit.Worker(argv(inputs, state, MLX_LONG), lines, command=launcher(2))
    assert w.wait_for("tune: step 7/"), w.finish().stderr
    pid = rank_pid(w, 1)
    os.kill(pid, getattr(signal, how))
    silent = f"no answer in {GROUP_TIMEOUT} s"
    if how == "SIGSTOP":
        assert w.wait_for(silent)
        os.kill(pid, signal.SIGCONT)  # mlx.launch waits for it; it finds rank 0 gone
    leg = w.finish()
    assert exited(leg.stderr, 0) == 75, leg.stderr
    [line] = [ln for ln in leg.stderr.splitlines() if ln.startswith("spill: error: rank 0")]
    why = "connection to a peer was lost" if how == "SIGKILL" else silent
    assert f"another process of this job is gone ({why})" in line
    assert kit.committed_steps(str(state))[-1] >= 5
    again = launch(2, argv(inputs, state, MLX_LONG), env)
    assert (exited(again.stderr, 0), exited(again.stderr, 1)) == (0, 0), again.stderr
    assert same_run(str(state), controls["long"], MLX_LONG["steps"])


def test_rank_0s_refusal_is_said_once(inputs, tmp_path):
    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    assert kit.run_tune(argv(inputs, state, MLX, stop_after=2), env).returncode == 0
    other = launch(2, argv(inputs, state, MLX, lr=0.02), env)
    assert (exited(other.stderr, 0), exited(other.stderr, 1)) == (1, 1), other.stderr
    [line] = [ln for ln in other.stderr.splitlines() if "error" in ln]
    assert "was made with learning rate 0.01, this run has 0.02" in line


@pytest.mark.parametrize("verb", ["run", "eval"])
def test_a_row_job_at_two_ranks_writes_what_one_process_writes(inputs, rows, tmp_path, verb):
    env = kit.spill_env(tmp_path / "home")
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    done = kit.run_tune(rows_argv(verb, inputs, rows, one, "--engine", "mlx"), env)
    assert done.returncode == 0, done.stderr
    done = launch(2, rows_argv(verb, inputs, rows, two, "--engine", "mlx"), env)
    assert (exited(done.stderr, 0), exited(done.stderr, 1)) == (0, 0), done.stderr
    assert "2 processes, a batch each" in done.stderr
    assert done.stderr.count("wrote 13 ") == 1  # rank 0 writes for the job
    assert two.read_bytes() == one.read_bytes()
