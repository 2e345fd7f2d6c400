"""The preemption guard in real processes with real signals and short time limits.

Each test runs a worker: a loop of quanta (``time.sleep`` standing for the work) whose committed
state is ``{"step", "a", "b"}``, mutated under ``guard.mutating()`` (``a`` first, ``b`` last),
and saved to a JSON file by the guard's save callback. The worker prints ``start <k>`` before
quantum k's work and ``mutating <k>`` inside its mutation, so the test signals at a known point.
Nothing is mocked: the signal is a real SIGTERM/SIGINT and the exit code is the process's own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

WORKER = r"""
import json, os, sys, time
from spill.jobs.preempt import Guard, Preempted

cfg = json.loads(sys.argv[1])
state = {"step": 0, "a": 0, "b": 0}

def save():
    time.sleep(cfg.get("save_s", 0))
    tmp = cfg["path"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, cfg["path"])
    return f"step {state['step']}"

try:
    with Guard(save=save, unit="step", grace=cfg["grace"], deadline=cfg.get("deadline")) as guard:
        for k, seconds in enumerate(cfg["quanta"], 1):
            guard.boundary()
            print(f"start {k}", flush=True)
            time.sleep(seconds)
            with guard.mutating():
                state["a"] = k
                print(f"mutating {k}", flush=True)
                time.sleep(cfg.get("mutate_s", 0))
                state["b"] = k
                state["step"] = k
except Preempted as e:
    sys.exit(e.exit_code)
print("done", flush=True)
"""


def _start(tmp_path: Path, **cfg) -> tuple[subprocess.Popen, Path]:
    path = tmp_path / "state.json"
    cfg = {"path": str(path), **cfg}
    proc = subprocess.Popen(
        [sys.executable, "-c", WORKER, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    return proc, path


def _wait_for(proc: subprocess.Popen, line: str) -> None:
    for got in proc.stdout:
        if got.strip() == line:
            return
    raise AssertionError(f"the worker ended before printing {line!r}: {proc.stderr.read()}")


def _stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 30) -> tuple[float, str]:
    t = time.monotonic()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=timeout)
    return time.monotonic() - t, err


def test_a_quantum_that_ends_within_grace_is_finished(tmp_path):
    proc, path = _start(tmp_path, quanta=[0.01] * 3 + [1.0] + [0.01] * 50, grace=10, deadline=20)
    _wait_for(proc, "start 4")
    took, err = _stop(proc)
    print(f"\nSIGTERM to exit, quantum of 1 s finished: {took:.2f} s")
    assert proc.returncode == 75, err
    assert "preempted by SIGTERM" in err and "committed: step 4" in err
    assert "abandoned" not in err
    assert json.loads(path.read_text()) == {"step": 4, "a": 4, "b": 4}


def test_a_quantum_past_grace_is_abandoned_and_the_previous_one_saved(tmp_path):
    proc, path = _start(tmp_path, quanta=[0.01] * 3 + [60], grace=0.5, deadline=10)
    _wait_for(proc, "start 4")
    took, err = _stop(proc)
    print(f"\nSIGTERM to exit, 60 s quantum abandoned at a 0.5 s grace: {took:.2f} s")
    assert proc.returncode == 75, err
    assert "abandoned" in err and "committed: step 3" in err
    assert json.loads(path.read_text()) == {"step": 3, "a": 3, "b": 3}


def test_the_watchdog_never_saves_a_half_applied_quantum(tmp_path):
    # the signal lands inside a 2 s mutation; the grace (0.2 s) ends before the mutation does
    proc, path = _start(tmp_path, quanta=[0.01] * 5, mutate_s=2.0, grace=0.2, deadline=20)
    _wait_for(proc, "mutating 2")
    _, err = _stop(proc)
    assert proc.returncode == 75, err
    assert json.loads(path.read_text()) == {"step": 2, "a": 2, "b": 2}


def test_hard_deadline_ends_a_hanging_save(tmp_path):
    proc, path = _start(tmp_path, quanta=[0.01] * 2 + [60], save_s=60, grace=0.2, deadline=1.0)
    _wait_for(proc, "start 3")
    took, err = _stop(proc, timeout=20)
    print(f"\nSIGTERM to exit through the 1 s hard deadline: {took:.2f} s")
    assert proc.returncode == 75, err
    assert "not finished 1 s after" in err
    assert not path.exists()  # the save never completed; nothing half-written either
    assert not any(p.name.endswith(".tmp") and p.stat().st_size for p in tmp_path.iterdir())


def test_second_ctrl_c_does_not_interrupt_the_save(tmp_path):
    proc, path = _start(tmp_path, quanta=[0.01] * 2 + [0.3] + [0.01] * 50, save_s=1.0, grace=10)
    _wait_for(proc, "start 3")
    proc.send_signal(signal.SIGINT)
    time.sleep(0.6)  # quantum 3 has ended; the 1 s save is under way
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 75, err
    assert "preempted by SIGINT" in err and "SIGINT again" in err
    assert "Traceback" not in err
    assert json.loads(path.read_text()) == {"step": 3, "a": 3, "b": 3}


def test_no_signal_runs_to_the_end(tmp_path):
    proc, path = _start(tmp_path, quanta=[0.0] * 3, grace=1, deadline=2)
    out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert out.splitlines()[-1] == "done" and not path.exists()


def test_env_sets_the_limits(monkeypatch):
    from spill.jobs.preempt import Guard

    monkeypatch.setenv("SPILL_PREEMPT_GRACE", "2.5")
    monkeypatch.setenv("SPILL_PREEMPT_DEADLINE", "7")
    guard = Guard(signals=())
    assert (guard.grace, guard.deadline) == (2.5, 7.0)
    assert Guard(grace=1, deadline=3, signals=()).deadline == 3
    monkeypatch.delenv("SPILL_PREEMPT_GRACE")
    monkeypatch.delenv("SPILL_PREEMPT_DEADLINE")
    assert (Guard(signals=()).grace, Guard(signals=()).deadline) == (15.0, 30.0)
    assert os.environ.get("SPILL_PREEMPT_GRACE") is None


# --- one switch per process: request_stop, stops_at_once, a job inside a build ---------------

SCOPE = r"""
import json, sys, threading, time
from spill.jobs.preempt import Guard, critical, request_stop, stops_at_once
from spill.errors import SpillError

cfg = json.loads(sys.argv[1])
try:
    with stops_at_once():
        print("ready", flush=True)
        if cfg["mode"] == "critical":
            with critical():
                print("in critical", flush=True)
                time.sleep(cfg["hold"])
                print("critical done", flush=True)
        elif cfg["mode"] == "nested":
            with Guard(save=lambda: "step 2", unit="step") as guard:
                for k in range(1, 500):
                    guard.boundary()
                    if k == 2:
                        threading.Thread(target=request_stop, args=("a move",)).start()
                    time.sleep(0.02)
        time.sleep(cfg.get("idle", 30))
except SpillError as e:
    print("caught:", e, flush=True)
    sys.exit(e.exit_code)
print("done", flush=True)
"""


def _scope(**cfg) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", SCOPE, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_outside_a_job_a_signal_stops_at_once_with_one_line():
    proc = _scope(mode="idle")
    _wait_for(proc, "ready")
    _, err = _stop(proc, signal.SIGINT)
    assert proc.returncode == 75, err
    lines = [x for x in err.splitlines() if "preempted" in x]
    assert lines == [
        "spill: build preempted by SIGINT; nothing new to commit; exit 75; "
        "run the same command to continue"
    ], err


def test_a_critical_section_finishes_before_the_stop():
    proc = _scope(mode="critical", hold=0.5)
    _wait_for(proc, "in critical")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 75, err
    assert out.splitlines()[0] == "critical done", out  # the section ended first
    assert "done" not in out.splitlines()[1:], out  # and nothing after it ran
    assert err.count("preempted by SIGTERM") == 1, err


def test_request_stop_reaches_a_job_inside_a_build_which_words_the_stop():
    """The programmatic entry (``spill move``'s quiesce) from another thread: the job saves at
    its boundary and stays quiet; the enclosing scope's caller words the one line."""
    proc = _scope(mode="nested")
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 75, err
    assert "spill: a move; finishing the current step" in err
    assert "preempted" not in err  # a build would catch the job's stop and say where it stands
    assert "caught: preempted by a move after" in out and "committed: step 2" in out
