"""Kill drills: a real worker process SIGKILLs itself at each named boundary of a payload write.

After each kill the reader must see the previous committed state (the run's pointer never names
what the dead writer left), and the next writer, which takes the run over at once (the owner
process is gone), must clean what the dead writer left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from spill.control.control import Busy
from spill.control.ownership import acquire
from spill.control.place import Place
from spill.payloads.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, settle
from spill.payloads.rows import restore
from spill.store import fs
from spill.store.location import location

WORKER = Path(__file__).with_name("payload_worker.py")


def assert_killed(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, proc.stderr[-2000:])


def payloads(root: str, kind: str) -> list[str]:
    settle()  # this process's saves remove older folders on a thread of their own
    return [n for n in fs.listdir(fs.join(root, "payloads")) if n.startswith(kind + "-")]


def latest(root: str):
    return latest_checkpoint(Place(root))


@pytest.mark.parametrize(
    "boundary, left",
    [
        ("ckpt-between-files", ["params.safetensors"]),
        ("ckpt-before-commit", ["opt.safetensors", "params.safetensors", "state.json"]),
    ],
)
def test_checkpoint_killed_before_commit(tmp_path, run_worker, data, boundary, left):
    root = location(tmp_path / "state")
    proc = run_worker("ckpt", root, "1", "2", "3", drill=f"{boundary}@3")
    assert_killed(proc)
    assert proc.stdout.split("\n")[:2] == ["saved 1", "saved 2"] and "saved 3" not in proc.stdout
    assert fs.listdir(fs.join(root, "payloads", "ckpt-g1-s3-0")) == left
    ckpt = latest(root)
    assert ckpt.step == 2
    assert load_checkpoint(ckpt).state["cursor"] == data(2)[2]["cursor"]
    place = acquire(root).place()  # the resumed job takes the run over at once
    save_checkpoint(place, 3, *data(3))  # and its next save
    assert payloads(root, "ckpt") == ["ckpt-g1-s2-0", "ckpt-g2-s3-0"]
    assert latest(root).step == 3


def test_checkpoint_killed_after_commit_before_rotation(tmp_path, run_worker, data):
    root = location(tmp_path / "state")
    assert_killed(run_worker("ckpt", root, "1", "2", "3", drill="ckpt-after-commit@3"))
    # step 3 is published; step 1 is no longer pointed at but not yet removed
    assert payloads(root, "ckpt") == ["ckpt-g1-s1-0", "ckpt-g1-s2-0", "ckpt-g1-s3-0"]
    assert [u.rsplit("-s", 1)[1] for u in Place(root).pointer("ckpt")] == ["3-0", "2-0"]
    assert latest(root).step == 3
    save_checkpoint(acquire(root).place(), 4, *data(4))
    assert payloads(root, "ckpt") == ["ckpt-g1-s3-0", "ckpt-g2-s4-0"]


def test_checkpoint_killed_before_commit_on_s3(s3_bucket, run_worker, data):
    root = location(f"s3://{s3_bucket}/job")
    assert_killed(run_worker("ckpt", root, "1", "2", drill="ckpt-before-commit@2"))
    assert "COMMIT" not in fs.listdir(fs.join(root, "payloads", "ckpt-g1-s2-0"))
    assert latest(root).step == 1
    save_checkpoint(acquire(root).place(), 2, *data(2))
    assert payloads(root, "ckpt") == ["ckpt-g1-s1-0", "ckpt-g2-s2-0"]
    loaded = load_checkpoint(latest(root))
    assert loaded.state["step"] == 2 and set(loaded.params) == set(data(2)[0])


def test_paused_writer_can_be_inspected_then_killed(tmp_path, data):
    root = location(tmp_path / "state")
    env = {**os.environ, "SPILL_DRILL": "ckpt-before-commit@2:stop"}
    proc = subprocess.Popen([sys.executable, str(WORKER), "ckpt", root, "1", "2"], env=env)
    try:
        _, status = os.waitpid(proc.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status)
        assert "COMMIT" not in fs.listdir(fs.join(root, "payloads", "ckpt-g1-s2-0"))
        assert latest(root).step == 1
        with pytest.raises(Busy, match=f"pid {proc.pid}"):  # one writer: the paused one
            acquire(root)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -signal.SIGKILL


def test_segment_push_killed_before_commit(tmp_path, run_worker):
    root = location(tmp_path / "state")
    assert_killed(run_worker("rows", root, "0", "60", drill="seg-before-commit@2"))
    assert restore(Place(root)).done == [f"r{i}" for i in range(25)]
    assert fs.listdir(fs.join(root, "payloads", "rows-g1-s1-0")) == ["rows.jsonl"]
    proc = run_worker("rows", root, "25", "60")  # the continuing job runs only what is left
    assert proc.returncode == 0, proc.stderr
    rows, done = restore(Place(root))
    assert done == [f"r{i}" for i in range(60)] and [r["out"] for r in rows] == [
        i * i for i in range(60)
    ]
    assert payloads(root, "rows") == ["rows-g1-s0-0", "rows-g2-s1-0", "rows-g2-s2-0"]


def test_local_put_killed_before_rename_leaves_only_removable_litter(tmp_path, run_worker):
    root = location(tmp_path / "state")
    # put 1 is rows/identity.json, put 2 segment 0's rows.jsonl, put 3 its COMMIT
    assert_killed(run_worker("rows", root, "0", "30", drill="put-before-rename@3"))
    names = fs.listdir(fs.join(root, "payloads", "rows-g1-s0-0"))
    assert "COMMIT" not in names and any(fs.is_temp(n) for n in names)
    assert restore(Place(root)).done == []
    assert run_worker("rows", root, "0", "30").returncode == 0
    assert not [n for _, _, files in os.walk(root) for n in files if fs.is_temp(n)]
    assert payloads(root, "rows") == ["rows-g2-s0-0", "rows-g2-s1-0"]
    assert restore(Place(root)).done == [f"r{i}" for i in range(30)]


def test_unknown_drill_is_an_error(tmp_path, run_worker):
    proc = run_worker("ckpt", location(tmp_path / "s"), "1", drill="ckpt-betwen-files")
    assert proc.returncode == 1 and "ckpt-between-files" in proc.stderr
