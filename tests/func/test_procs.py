"""One tune over several processes, through the real CLI and torch's own launchers: ``spill tune
--procs N`` (torch's elastic launcher) and ``torchrun --nnodes 2`` (a c10d rendezvous on
loopback). World sizes 1, 2 and 4 write the same checkpoints bit for bit (float32, one thread
per process), a run continues at another world size after real kills (a rank SIGKILLed between
steps, rank 0 SIGKILLed in the middle of a publication, a SIGTERM to the launcher), and a second
launch on the same state is refused in one line naming the owner.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from spill.payloads.checkpoint import OPT, PARAMS, STATE
from tests.func import tune_kit as kit

# four micro-batches a step: world 2 computes two each, world 4 one each
SHORT = {**kit.SETTINGS, "batch": 8, "micro_batch": 2, "steps": 4, "ckpt_every": 2}
LONG = {**SHORT, "steps": 200, "ckpt_every": 5}  # long enough to stop in the middle of


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("procs")
    return {"model": tiny_models["llama"], "train": kit.write_train(root / "train.jsonl")}


def argv(inputs, state, settings, **over) -> list[str]:
    return kit.tune_argv(inputs["model"], inputs["train"], str(state), **{**settings, **over})


def tune(inputs, state, settings, env, *extra, **over) -> subprocess.CompletedProcess:
    return kit.run_tune([*argv(inputs, state, settings, **over), *extra], env)


@pytest.fixture(scope="module")
def controls(inputs, tmp_path_factory):
    """The uninterrupted one-process runs of SHORT and LONG."""
    root = tmp_path_factory.mktemp("procs-control")
    env = kit.spill_env(root / "home")
    out = {}
    for name, settings in (("short", SHORT), ("long", LONG)):
        done = tune(inputs, root / name, settings, env)
        assert done.returncode == 0, done.stderr
        out[name] = str(root / name)
    return out


def same_run(state: str, control: str, step: int) -> list[dict]:
    """Every tensor, loss and cursor of ``state``'s step equals the control's; the state differs
    only in its producer ranges, which are returned."""
    got, want = kit.files(state, step), kit.files(control, step)
    for name in (PARAMS, OPT):
        a, b = kit.tensors(got[name]), kit.tensors(want[name])
        assert sorted(a) == sorted(b), name
        for key in b:
            assert np.array_equal(a[key], b[key]), f"{name}: {key} differs from one process's"
    mine, theirs = json.loads(got[STATE]), json.loads(want[STATE])
    producers = mine.pop("producers")
    theirs.pop("producers")
    assert mine == theirs  # losses, cursor, identity
    return producers


def resumed(done: subprocess.CompletedProcess) -> int | None:
    return kit.resumed_from(done.stderr, LONG["steps"], LONG["batch"] // LONG["micro_batch"])


def ranges(producers: list[dict]) -> list[tuple[int, int, int]]:
    return [(p["from_step"], p["to_step"], p.get("procs", 1)) for p in producers]


@pytest.mark.parametrize("procs", [2, 4])
def test_world_sizes_write_the_same_checkpoints(inputs, controls, tmp_path, procs):
    state = tmp_path / "state"
    done = tune(inputs, state, SHORT, kit.spill_env(tmp_path / "home"), "--procs", str(procs))
    assert done.returncode == 0, done.stderr
    assert f"· {procs} processes, each its own ring and --memory" in done.stderr
    assert done.stderr.count("adapter written to") == 1  # rank 0 speaks for the job
    assert ranges(same_run(str(state), controls["short"], 4)) == [(0, 4, procs)]
    assert (
        kit.adapter_files(str(state))["params.safetensors"]
        == (kit.adapter_files(controls["short"])["params.safetensors"])
    )


@pytest.mark.mlx
def test_mlx_ranks_write_what_one_mlx_process_writes(inputs, tmp_path):
    """The exchange is engine-neutral (float32 numpy over gloo): two MLX ranks, one MLX run."""
    pytest.importorskip("mlx.core")
    env = kit.spill_env(tmp_path / "home")
    mlx = {**SHORT, "engine": "mlx", "dropout": 0}
    one, two = tmp_path / "one", tmp_path / "two"
    assert tune(inputs, one, mlx, env).returncode == 0
    done = tune(inputs, two, mlx, env, "--procs", "2")
    assert done.returncode == 0, done.stderr
    assert ranges(same_run(str(two), str(one), 4)) == [(0, 4, 2)]


@pytest.mark.cuda
def test_ranks_on_their_own_gpus_write_what_one_gpu_writes(inputs, tmp_path):
    """Each rank on cuda:LOCAL_RANK, the gradients over NCCL on the GPUs; the fold is in
    micro-batch order on the host, so two GPUs write what one writes (float32, same GPU model).
    Not run where this was written (no GPU): it needs two CUDA devices."""
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs two CUDA devices for NCCL; torch sees {torch.cuda.device_count()}")
    env = kit.spill_env(tmp_path / "home")
    cuda = {**SHORT, "device": "cuda"}
    one, two = tmp_path / "one", tmp_path / "two"
    done = tune(inputs, one, cuda, env)
    assert done.returncode == 0, done.stderr
    done = tune(inputs, two, cuda, env, "--procs", "2")
    assert done.returncode == 0, done.stderr
    assert ranges(same_run(str(two), str(one), 4)) == [(0, 4, 2)]


def test_a_stop_of_one_rank_stops_every_rank_at_the_same_step(inputs, controls, tmp_path):
    """SIGTERM to rank 1 alone: the ranks agree at the next boundary, rank 0 commits, 75."""
    import psutil

    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    lines = {**env, "SPILL_PROGRESS": "lines", "SPILL_PROGRESS_EVERY": "0"}
    w = kit.Worker([*argv(inputs, state, LONG), "--procs", "2"], lines)
    assert w.wait_for("tune: step 3/")
    [rank1] = [c for c in psutil.Process(w.proc.pid).children() if c.environ().get("RANK") == "1"]
    rank1.send_signal(signal.SIGTERM)
    done = w.finish()
    assert done.returncode == 75, done.stderr
    assert "preempted by a stop of another process of this job" in done.stderr
    stopped = kit.committed_steps(str(state))[-1]
    assert 3 <= stopped < LONG["steps"]
    again = tune(inputs, state, LONG, env, "--procs", "2")
    assert again.returncode == 0, again.stderr
    assert ranges(same_run(str(state), controls["long"], LONG["steps"])) == [(0, LONG["steps"], 2)]


def test_a_run_continues_at_other_world_sizes_after_kills(inputs, controls, tmp_path):
    """2 processes (rank 1 SIGKILLed at its 12th step) -> 1 (SIGKILLed in the middle of its
    third publication) -> 2 (SIGTERM to the launcher) -> 1: the one-process run's bits."""
    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    leg = tune(inputs, state, LONG, {**env, "SPILL_DRILL": "rank-step@12"}, "--procs", "2")
    assert leg.returncode == 75, leg.stderr
    assert leg.stderr.count("another process of this job is gone") == 1, leg.stderr
    assert kit.committed_steps(str(state))[-1] == 10  # steps 11 and 12 were not committed

    leg = tune(inputs, state, LONG, {**env, "SPILL_DRILL": "ckpt-between-files@3"})
    assert leg.returncode == -signal.SIGKILL, leg.stderr
    assert resumed(leg) == 10
    assert kit.committed_steps(str(state))[-1] == 20  # the publication of step 25 died

    lines = {**env, "SPILL_PROGRESS": "lines", "SPILL_PROGRESS_EVERY": "0"}  # a line a step
    w = kit.Worker([*argv(inputs, state, LONG), "--procs", "2"], lines)
    assert w.wait_for("tune: step 27/")  # past the commit of step 25
    w.proc.send_signal(signal.SIGTERM)
    leg = w.finish()
    assert leg.returncode == 75, leg.stderr
    assert leg.stderr.count("preempted by SIGTERM") == 1, leg.stderr
    stopped = kit.committed_steps(str(state))[-1]
    assert 25 <= stopped < LONG["steps"]

    leg = tune(inputs, state, LONG, env)
    assert leg.returncode == 0, leg.stderr
    assert resumed(leg) == stopped
    got = ranges(same_run(str(state), controls["long"], LONG["steps"]))
    assert got == [(0, 10, 2), (10, 20, 1), (20, stopped, 2), (stopped, LONG["steps"], 1)]
    assert kit.litter(str(state)) == []


def test_a_lost_rank_is_said_by_the_launcher_when_no_rank_could(inputs, tmp_path):
    """Rank 1 SIGKILLed before its 12th step, and rank 0 SIGKILLed where it finds the group lost,
    before it says so (``group-lost``: as torch's teardown SIGTERM may end it under load): the
    launcher says the line, once, naming how each rank ended; rank 0's commit of step 10 stands."""
    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    drills = {**env, "SPILL_DRILL": "rank-step@12,group-lost"}
    leg = tune(inputs, state, LONG, drills, "--procs", "2")
    assert leg.returncode == 75, leg.stderr
    [line] = [ln for ln in leg.stderr.splitlines() if "another process of this job is gone" in ln]
    assert line.startswith("spill: error: the launcher: another process of this job is gone (")
    assert "rank 1 ended by SIGKILL" in line and "rank 0 ended by SIGKILL" in line, line
    assert kit.committed_steps(str(state))[-1] == 10
    assert tune(inputs, state, LONG, env, stop_after=12).returncode == 0  # the run was let go


def _rank_pids(pid: int) -> dict[int, int]:
    """The ranks under a launcher (``--procs``, torchrun), by rank."""
    import psutil

    out = {}
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if (rank := child.environ().get("RANK")) is not None:
                out[int(rank)] = child.pid
    return out


def _kill_family(pid: int) -> None:
    for child in _children(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_a_rank_sigkilled_in_the_middle_of_a_step_continues_at_other_world_sizes(
    inputs, controls, tmp_path
):
    """Four launches, each at another world size than the last, each losing one rank (any,
    rank 0 too) to SIGKILL at a random moment inside a step (a random fraction of the step time
    just measured, after a step past the last commit); then one that finishes: the
    uninterrupted one-process run's bits, each range at the world size that computed it."""
    import random

    rng = random.Random(2323)
    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    lines = {**env, "SPILL_PROGRESS": "lines", "SPILL_PROGRESS_EVERY": "0"}  # a line a step
    sizes, want = [2], []
    for attempt in range(4):
        procs, last = sizes[-1], (kit.committed_steps(str(state)) or [0])[-1]
        w = kit.Worker([*argv(inputs, state, LONG), "--procs", str(procs)], lines)
        at = last + rng.randint(6, 11)  # past the next commit: every attempt adds a range
        assert w.wait_for(f"tune: step {at}/"), attempt
        t0 = time.monotonic()
        assert w.wait_for(f"tune: step {at + 1}/"), attempt
        time.sleep(rng.uniform(0.0, time.monotonic() - t0))  # inside step at + 2
        ranks = _rank_pids(w.proc.pid) if procs > 1 else {0: w.proc.pid}
        os.kill(ranks[rng.choice(sorted(ranks))], signal.SIGKILL)
        done = w.finish()
        assert done.returncode == (75 if procs > 1 else -signal.SIGKILL), (attempt, done.stderr)
        stopped = kit.committed_steps(str(state))[-1]
        assert at - 5 < stopped <= at + 2, (attempt, at, stopped)
        want.append((last, stopped, procs))
        sizes.append(rng.choice([n for n in (1, 2, 3) if n != procs]))
    done = tune(inputs, state, LONG, env, "--procs", str(sizes[-1]))
    assert done.returncode == 0, done.stderr
    want.append((want[-1][1], LONG["steps"], sizes[-1]))
    assert ranges(same_run(str(state), controls["long"], LONG["steps"])) == want
    assert kit.litter(str(state)) == []


@pytest.mark.slow
def test_torchrun_restarts_a_group_that_lost_a_rank(inputs, controls, tmp_path):
    """``torchrun --max-restarts 1``: rank 1 SIGKILLed in the middle of the run, rank 0 exits 75
    (``GroupLost``), which torchrun counts as the group's failure: it starts both ranks again,
    they continue from rank 0's last commit and finish with the one-process run's bits. (The
    restarted ranks meet under keys of their own attempt in the store torchrun's agent keeps
    across restarts; on the agent's own keys they hung or were refused two times in three.)"""
    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    lines = {**env, "SPILL_PROGRESS": "lines", "SPILL_PROGRESS_EVERY": "0"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--max-restarts", "1", "--nproc-per-node", "2", "-m", "spill"]  # fmt: skip
    w = kit.Worker(argv(inputs, state, LONG), lines, command=torchrun)
    assert w.wait_for("tune: step 13/")
    time.sleep(0.05)
    os.kill(_rank_pids(w.proc.pid)[1], signal.SIGKILL)
    family = threading.Timer(kit.TIMEOUT - 10, _kill_family, (w.proc.pid,))  # the ranks first:
    family.start()  # a hung restart would hold the pipes the finish reads after its launcher
    try:
        done = w.finish()
    finally:
        family.cancel()
    assert done.returncode == 0, done.stderr
    assert "another process of this job is gone" in done.stderr
    assert resumed(done) in (10, 15)
    assert ranges(same_run(str(state), controls["long"], LONG["steps"])) == [(0, LONG["steps"], 2)]


def test_a_second_launch_on_the_same_state_is_refused_naming_the_owner(inputs, tmp_path):
    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    # rank 1 stops itself (SIGSTOP) at its 3rd step: the group holds the run, waiting
    first = kit.Worker(
        [*argv(inputs, state, LONG), "--procs", "2"],
        {**env, "SPILL_DRILL": "rank-step@3:stop", "SPILL_PROGRESS": "1"},
    )
    try:
        assert first.wait_for(kit.BAR)
        second = tune(inputs, state, LONG, env, "--procs", "2")
        assert second.returncode == 75, second.stderr
        [line] = [ln for ln in second.stderr.splitlines() if "error" in ln]
        assert f"at {state} is held by" in line and "pid" in line and "--wait" in line
        alone = tune(inputs, state, LONG, env)  # one process is refused the same way
        assert alone.returncode == 75 and f"at {state} is held by" in alone.stderr
    finally:  # the ranks first: they hold the pipes the launcher's reader waits on
        for child in _children(first.proc.pid):
            os.kill(child, signal.SIGKILL)
        first.proc.kill()
        first.finish()


def _children(pid: int) -> list[int]:
    import psutil

    try:
        return [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def test_rank_0s_refusal_is_said_once_and_is_every_ranks_exit(inputs, tmp_path):
    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    assert tune(inputs, state, SHORT, env, stop_after=2).returncode == 0
    other = tune(inputs, state, SHORT, env, "--procs", "2", lr=0.02)
    assert other.returncode == 1, other.stderr
    [line] = [ln for ln in other.stderr.splitlines() if "error" in ln]
    assert "was made with learning rate 0.01, this run has 0.02" in line


def test_torchrun_two_nodes_on_loopback(inputs, controls, tmp_path):
    """Two ``torchrun --nnodes 2 --node-rank K`` launchers meet at one c10d endpoint."""
    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node-rank",
                str(k),
                "--nproc-per-node",
                "1",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                "spill-test",
                "-m",
                "spill",
                *argv(inputs, state, SHORT),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for k in (0, 1)
    ]
    outs = [n.communicate(timeout=kit.TIMEOUT) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs
    assert ranges(same_run(str(state), controls["short"], 4)) == [(0, 4, 2)]


# --- what a --procs run opens and leaves behind (issue 35, items 15 and 16) -------------------


def _listening(pids: set[int]) -> list[tuple[str, int, int]]:
    """``(address, port, pid)`` of every TCP socket in LISTEN that the processes ``pids`` hold:
    /proc/net/tcp and tcp6 rows matched to the processes by the inodes of their socket fds."""
    import ipaddress

    inodes = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        inodes[int(link[8:-1])] = pid
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError), open(table) as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                local, state, inode = cols[1], cols[3], int(cols[9])
                if state != "0A" or inode not in inodes:  # 0A: TCP_LISTEN
                    continue
                addr, port = local.split(":")
                raw = b"".join(bytes.fromhex(addr[i : i + 8])[::-1] for i in range(0, len(addr), 8))
                ip = ipaddress.ip_address(raw)
                out.append((str(ip), int(port, 16), inodes[inode]))
    return out


def _loopback(address: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_every_socket_a_procs_run_listens_on_is_on_loopback(inputs, tmp_path):
    """The launcher's rendezvous store, the store its ranks meet at and gloo's own listeners:
    each bound to loopback, none to every interface, while two ranks train."""
    import psutil

    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    lines = {**env, "SPILL_PROGRESS": "lines", "SPILL_PROGRESS_EVERY": "0"}
    w = kit.Worker([*argv(inputs, state, LONG), "--procs", "2"], lines)
    try:
        assert w.wait_for("tune: step 3/")
        family = {w.proc.pid, *(c.pid for c in psutil.Process(w.proc.pid).children(True))}
        listening = _listening(family)
    finally:
        w.proc.send_signal(signal.SIGTERM)
        done = w.finish()
    assert done.returncode == 75, done.stderr
    assert {pid for _, _, pid in listening} >= {w.proc.pid}, listening  # the launcher's stores
    assert [x for x in listening if not _loopback(x[0])] == [], listening


@pytest.mark.skipif(sys.platform != "linux", reason="a parent-death signal is Linux's (prctl)")
def test_ranks_die_with_a_sigkilled_launcher_and_leave_the_run_free(inputs, tmp_path):
    """``spill tune --procs 2`` SIGKILLed: both ranks get their parent-death signal, stop at
    the next step (rank 0 commits) within seconds, and the same command run again continues
    at once from that commit: no lease is left held, no wait."""
    import psutil

    state, env = tmp_path / "state", kit.spill_env(tmp_path / "home")
    lines = {**env, "SPILL_PROGRESS": "lines", "SPILL_PROGRESS_EVERY": "0"}
    w = kit.Worker([*argv(inputs, state, LONG), "--procs", "2"], lines)
    assert w.wait_for("tune: step 8/")  # past the commit of step 5
    ranks = [psutil.Process(p) for p in _rank_pids(w.proc.pid).values()]
    assert len(ranks) == 2
    guard = threading.Timer(60, _kill_family, (w.proc.pid,))  # a rank that never goes
    guard.start()
    try:
        w.proc.kill()  # the launcher, SIGKILL: it hands nothing on
        t0 = time.monotonic()
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        took = time.monotonic() - t0
        for p in alive:  # (only where the test fails)
            p.kill()
        done = w.finish()
    finally:
        guard.cancel()
    assert alive == [], (alive, done.stderr)
    assert took < 30, took  # (a step and a commit of the tiny model: 1.7 s here)
    assert done.returncode == -signal.SIGKILL
    assert "Traceback" not in done.stderr, done.stderr
    stopped = kit.committed_steps(str(state))[-1]
    assert 5 <= stopped < LONG["steps"]  # (orphans ran on to step 200)
    again = tune(inputs, state, LONG, env, "--procs", "2", stop_after=stopped + 5)
    assert again.returncode == 0, again.stderr  # not 75: no owner holds the run
    assert "is held by" not in again.stderr
    assert resumed(again) == stopped
    assert kit.committed_steps(str(state))[-1] == stopped + 5


# --- row jobs: rows shared round by round, every record to every rank, rank 0 commits ---------


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    root = tmp_path_factory.mktemp("procs-rows")
    prompts, graded = root / "prompts.jsonl", root / "test.jsonl"
    ask = [{"id": i, "prompt": f"Question {i}: what is {i} plus 3?"} for i in range(13)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ask))
    graded.write_text("".join(json.dumps(r | {"answer": f" {r['id'] + 3}."}) + "\n" for r in ask))
    return {"prompts": prompts, "test": graded}


def rows_argv(verb: str, inputs, rows, out, *extra) -> list[str]:
    model = str(inputs["model"])
    if verb == "eval":
        head = ["eval", model, str(rows["test"]), "--out", str(out)]
    else:
        head = [verb, model, str(rows["prompts"]), "--out", str(out), "--max-new-tokens", "6"]
    return [*head, "--batch", "2", "--dtype", "float32", *extra]


@pytest.mark.parametrize("verb", ["run", "eval", "distill"])
def test_row_jobs_over_processes_write_what_one_process_writes(inputs, rows, tmp_path, verb):
    env = kit.spill_env(tmp_path / "home")
    outs = {}
    for procs in (1, 2, 3):
        out = tmp_path / f"{verb}-{procs}.jsonl"
        done = kit.run_tune(rows_argv(verb, inputs, rows, out, "--procs", str(procs)), env)
        assert done.returncode == 0, done.stderr
        if procs > 1:
            assert f"{procs} processes, a batch each" in done.stderr
        assert done.stderr.count("wrote 13 ") == 1  # rank 0 writes for the job
        outs[procs] = out.read_bytes()
    assert outs[2] == outs[1] and outs[3] == outs[1]


def test_a_sharded_row_job_killed_continues_at_another_world_size(inputs, rows, tmp_path):
    """Rank 1 SIGKILLed before its 4th round: rank 0 commits the 6 rows done and exits 75; one
    process then runs only the 7 left, and the file is the uninterrupted run's."""
    env = kit.spill_env(tmp_path / "home")
    control = tmp_path / "control.jsonl"
    assert (
        kit.run_tune(rows_argv("run", inputs, rows, control, "--batch", "1"), env).returncode == 0
    )
    out, state = tmp_path / "out.jsonl", str(tmp_path / "state")
    argv = rows_argv("run", inputs, rows, out, "--batch", "1", "--state", state)
    killed = kit.run_tune([*argv, "--procs", "2"], {**env, "SPILL_DRILL": "rank-step@4"})
    assert killed.returncode == 75, killed.stderr
    assert killed.stderr.count("another process of this job is gone") == 1, killed.stderr
    assert not out.exists()
    again = kit.run_tune([*argv, "--json"], env)
    assert again.returncode == 0, again.stderr
    summary = json.loads(again.stdout)
    assert (summary["restored"], summary["ran"]) == (6, 7)  # none lost, none repeated
    assert out.read_bytes() == control.read_bytes()


# --- builds: every job of the build over the processes, rank 0 planning and recording ----------


def build(project, env, *extra) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spill", "build", str(project), "--json", *extra],
        capture_output=True, text=True, env=env, timeout=kit.TIMEOUT * 2,
    )  # fmt: skip


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy project built by one process: its stage results and adapter."""
    import shutil

    root = tmp_path_factory.mktemp("procs-build")
    source = Path(__file__).resolve().parents[2] / "projects" / "toy"
    shutil.copytree(source, root / "control", ignore=shutil.ignore_patterns(".spill"))
    env = kit.spill_env(root / "home")
    done = build(root / "control", env)
    assert done.returncode == 0, done.stderr
    return {"root": root, "source": source, "env": env, "stages": json.loads(done.stdout)["stages"]}


def fresh_toy(toy, name: str) -> Path:
    import shutil

    shutil.copytree(toy["source"], toy["root"] / name, ignore=shutil.ignore_patterns(".spill"))
    return toy["root"] / name


def adapter_bytes(project: Path) -> bytes:
    return (project / ".spill" / "adapters" / "toy" / "params.safetensors").read_bytes()


def test_a_build_with_engine_procs_runs_every_job_over_the_processes(toy):
    project = fresh_toy(toy, "procs")
    done = build(project, toy["env"], "engine.procs=2")  # spill.yaml's setting relaunches it
    assert done.returncode == 0, done.stderr
    stages = json.loads(done.stdout)["stages"]
    for name in ("eval:base", "tune", "eval"):
        assert stages[name]["result"] == toy["stages"][name]["result"], name
        assert [p.get("procs") for p in stages[name]["producers"]] == [2], name
    assert adapter_bytes(project) == adapter_bytes(toy["root"] / "control")
    shown = subprocess.run(
        [sys.executable, "-m", "spill", "status", str(project)],
        capture_output=True, text=True, env=toy["env"],
    )  # fmt: skip
    assert "torch float32 x 2 processes on" in shown.stdout


def test_a_build_that_lost_a_rank_continues_as_one_process(toy):
    """Rank 1 SIGKILLed inside the tune stage: the build stops (75); `spill build` as one process finishes it, the one-process build's results."""
    project = fresh_toy(toy, "killed")
    env = {**toy["env"], "SPILL_DRILL": "rank-step@150"}  # after tune committed step 100
    lost = build(project, env, "--procs", "2")
    assert lost.returncode == 75, lost.stderr
    # rank 0 notices the loss itself, or the launcher, seeing rank 1 die, stops it first
    assert "another process of this job is gone" in lost.stderr or "preempted" in lost.stderr
    again = build(project, toy["env"])
    assert again.returncode == 0, again.stderr
    stages = json.loads(again.stdout)["stages"]
    for name in ("eval:base", "tune", "eval"):
        assert stages[name]["result"] == toy["stages"][name]["result"], name
    assert [p.get("procs") for p in stages["tune"]["producers"]] == [2, None]
    assert adapter_bytes(project) == adapter_bytes(toy["root"] / "control")


def test_a_sharded_row_job_killed_at_random_moments_loses_and_repeats_no_row(inputs, tmp_path):
    """Four launches at 1 or 2 processes, each SIGKILLed (one rank, or every process) at a random
    moment after its pre-run line; then one that finishes: the uninterrupted file, and its
    restored and run rows add up to the input exactly once."""
    import random

    import psutil

    rng = random.Random(23)
    env = kit.spill_env(tmp_path / "home")
    prompts = tmp_path / "prompts.jsonl"
    ask = [{"id": i, "prompt": f"Question {i}: what is {i} plus 3?"} for i in range(120)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ask))
    model = str(inputs["model"])

    def argv(out, *extra):
        return ["run", model, str(prompts), "--out", str(out), "--batch", "1",
                "--max-new-tokens", "6", "--dtype", "float32", *extra]  # fmt: skip

    control = tmp_path / "control.jsonl"
    assert kit.run_tune(argv(control), env).returncode == 0
    out, state = tmp_path / "out.jsonl", str(tmp_path / "state")
    for attempt in range(4):
        procs = rng.choice([1, 2])
        w = kit.Worker([*argv(out, "--state", state), "--procs", str(procs)], env)
        assert w.wait_for("spill run · model"), attempt
        time.sleep(rng.uniform(0.0, 1.5))
        family = [w.proc, *(psutil.Process(w.proc.pid).children(recursive=True))]
        victims = [p for p in family if p.pid != w.proc.pid] or family
        for p in [rng.choice(victims)] if rng.random() < 0.5 else family:
            with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
                p.kill()
        done = w.finish()
        for p in family:  # nothing outlives the attempt
            with contextlib.suppress(psutil.NoSuchProcess):
                p.wait(timeout=30)
        assert done.returncode != 0 or out.exists(), (attempt, done.stderr)
    final = kit.run_tune([*argv(out, "--state", state), "--json"], env)
    assert final.returncode == 0, final.stderr
    summary = json.loads(final.stdout)
    assert summary["restored"] + summary["ran"] == len(ask)
    assert out.read_bytes() == control.read_bytes()
