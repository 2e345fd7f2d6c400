"""The authority core: acquire, leases, the dead-owner rule, fencing, completion, places, copies.

Transitions run on a local folder (a real flock), on ``memory://`` and on the S3 server over
HTTP (conditional PUTs). An owner that must be *another live process* (a lease, a copy, a
waiter) or a dead one (SIGKILL, a zombie) is a real child process (``control_worker.py hold``),
so those tests run where two processes can share the state: local and S3.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import jsonschema
import pytest

from spill.control.control import Busy, RunComplete, Superseded
from spill.control.keys import current
from spill.control.owner import _pid_state
from spill.control.ownership import acquire
from spill.errors import EXIT_PREEMPTED
from spill.ground.validate import load_schema
from spill.store import cas
from spill.store.cas import Unsupported
from spill.store.cas.local import mount_type
from spill.store.fs import exists, get_bytes, join, listdir, put_bytes
from spill.store.location import Location, location

WORKER = Path(__file__).parents[2] / "func" / "control_worker.py"
HOST = socket.gethostname()
PTR = "job/ckpt"


@pytest.fixture(params=["local", "s3"])
def shared(request, tmp_path) -> Location:
    """A state two processes can share: a local folder or a prefix on the S3 server."""
    if request.param == "local":
        return location(tmp_path / "state")
    return location(f"s3://{request.getfixturevalue('s3_bucket')}/state")


def _hold(state: str, *opts: str) -> subprocess.Popen:
    """A child that owns the run at ``state`` (``control_worker.py hold``), once it says so."""
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), "hold", state, *opts],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert line.startswith("acquired "), (line, proc.stderr.read() if proc.poll() else "")
    assert int(line.split()[2]) == proc.pid
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def _raw(state: str, key: str) -> dict:
    return json.loads(get_bytes(join(state, "runs", key)))


def _payload(uri: str) -> str:
    put_bytes(join(uri, "MANIFEST"), b"{}")
    return uri


def test_first_acquire_creates_the_run(root):
    run = acquire(root)
    runs = _raw(root, "current.json")
    doc = _raw(root, f"{runs['current']}/control.json")
    jsonschema.validate(runs, load_schema("runs"))
    jsonschema.validate(doc, load_schema("control"))
    assert runs["runs"] == [runs["current"]] == [run.id]
    assert doc["generation"] == run.gen == 1 and doc["status"] == "active"
    assert doc["owner"]["pid"] == os.getpid() and doc["owner"]["host"] == HOST
    assert doc["lineage"] == {"parent": None, "copied_from": None}
    assert doc == current(root)


def test_a_held_run_is_busy_then_free_after_release(root):
    run = acquire(root)
    with pytest.raises(Busy) as busy:
        acquire(root)
    assert busy.value.exit_code == EXIT_PREEMPTED == 75
    assert f"held by {HOST} pid {os.getpid()} since " in str(busy.value)
    assert "\n" not in str(busy.value)
    run.release()
    assert current(root)["owner"]["released"] is True
    again = acquire(root)
    assert again.gen == 2 and again.id == run.id
    assert current(root)["generation"] == 2


def test_a_live_owner_is_taken_over_only_after_its_lease(shared):
    holder = _hold(shared, "--lease", "1.5")
    try:
        expires = current(shared)["lease"]["expires"]
        attempts = []
        while True:
            t0 = time.time()
            try:
                run = acquire(shared)
            except Busy as e:
                attempts.append((t0, time.time()))
                assert f"pid {holder.pid} " in str(e)
                time.sleep(0.05)
                continue
            break
        # never acquired while the lease was live (``last.at`` is when the winner decided);
        # the holder was alive all along
        assert current(shared)["last"]["at"] >= expires
        assert all(start < expires for start, _ in attempts)
        assert holder.poll() is None
        assert run.gen == 2 and current(shared)["owner"]["pid"] == os.getpid()
    finally:
        _stop(holder)


def test_a_killed_owner_on_this_host_is_taken_over_at_once(shared):
    holder = _hold(shared)  # the default 120 s lease
    holder.kill()
    holder.wait()
    doc = current(shared)
    assert doc["owner"]["pid"] == holder.pid and doc["lease"]["expires"] > time.time() + 60
    run = acquire(shared)
    assert run.gen == 2


def test_a_zombie_owner_counts_as_gone(shared):
    holder = _hold(shared)
    try:
        os.kill(holder.pid, signal.SIGKILL)
        for _ in range(3000):  # dead, not yet reaped (nothing here waits for it)
            if _pid_state(holder.pid) == "Z":
                break
            time.sleep(0.01)
        assert _pid_state(holder.pid) == "Z"
        assert acquire(shared).gen == 2
        assert _pid_state(holder.pid) == "Z"
    finally:
        _stop(holder)


def test_a_superseded_owner_is_fenced(root):
    old = acquire(root, lease=0.3)
    old.publish({PTR: ["job/payloads/ckpt-g1-s1-0"]})
    while time.time() <= current(root)["lease"]["expires"]:
        time.sleep(0.05)
    new = acquire(root)
    assert new.gen == 2
    before = current(root)
    for attempt in (old.renew, lambda: old.publish({PTR: ["job/payloads/ckpt-g1-s2-0"]})):
        with pytest.raises(Superseded) as lost:
            attempt()
        message = str(lost.value)
        assert f"taken over by {HOST} pid {os.getpid()} (generation 2)" in message
        assert "\n" not in message
    old.release()  # a fenced owner's release changes nothing either
    assert current(root) == before
    assert before["pointers"] == {PTR: ["job/payloads/ckpt-g1-s1-0"]}
    new.publish({PTR: ["job/payloads/ckpt-g2-s2-0"]})
    assert current(root)["pointers"] == {PTR: ["job/payloads/ckpt-g2-s2-0"]}


def test_a_complete_run_is_read_only_and_a_new_run_descends_from_it(root):
    run = acquire(root)
    run.publish({PTR: ["job/payloads/ckpt-g1-s4-0"]})
    run.complete()
    done = current(root)
    assert done["status"] == "complete" and done["owner"]["released"] is True
    with pytest.raises(RunComplete):
        run.publish({PTR: ["job/payloads/ckpt-g1-s5-0"]})
    with pytest.raises(RunComplete):
        acquire(root)
    assert current(root) == done
    child = acquire(root, new_run=True)
    doc = current(root)
    assert child.id != run.id and doc["run"] == child.id
    assert doc["lineage"] == {"parent": run.id, "copied_from": None}
    assert doc["pointers"] == {PTR: ["job/payloads/ckpt-g1-s4-0"]}
    assert doc["generation"] == 2 and doc["status"] == "active"
    assert _raw(root, "current.json")["runs"] == [run.id, child.id]
    assert _raw(root, f"{run.id}/control.json") == done


def test_payload_names_and_collect(root):
    old = acquire(root, lease=0.3)
    place = old.place("job")
    first = _payload(place.payload("ckpt", 1))
    assert first == join(root, "job", "payloads", "ckpt-g1-s1-0")
    again = _payload(place.payload("ckpt", 1))  # a retry of step 1 never reuses a name
    assert again.endswith("/ckpt-g1-s1-1")
    kept = _payload(place.payload("ckpt", 2))
    other = _payload(place.payload("rows", 1))
    while time.time() <= current(root)["lease"]["expires"]:
        time.sleep(0.05)
    new = acquire(root)
    later = _payload(new.place("job").payload("ckpt", 3))
    assert later.endswith("/ckpt-g2-s3-0")
    place.collect("ckpt", {kept})
    left = sorted(listdir(join(root, "job", "payloads")))
    assert left == ["ckpt-g1-s2-0", "ckpt-g2-s3-0", "rows-g1-s1-0"]
    assert exists(join(kept, "MANIFEST")) and exists(join(other, "MANIFEST"))
    assert not exists(join(first, "MANIFEST")) and not exists(join(again, "MANIFEST"))


@pytest.mark.parametrize("where", ["/proc/spill-state", "/sys/spill-state"])
def test_states_on_pseudo_file_systems_are_refused(where):
    with pytest.raises(Unsupported) as e:
        acquire(location(where))
    assert "\n" not in str(e.value) and "s3://" in str(e.value)


def test_temporary_file_systems_are_accepted(tmp_path):
    assert mount_type(str(tmp_path)) in cas.FLOCK_FS
    assert acquire(location(tmp_path / "state")).gen == 1
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        shm = f"/dev/shm/spill-{uuid.uuid4().hex[:8]}"
        try:
            assert mount_type(shm) == "tmpfs"
            assert acquire(location(shm)).gen == 1
        finally:
            shutil.rmtree(shm, ignore_errors=True)


def test_a_copy_cannot_continue_while_the_original_is_held(tmp_path):
    original, copy = tmp_path / "a", tmp_path / "b"
    holder = _hold(str(original))
    try:
        shutil.copytree(original, copy)
        with pytest.raises(Busy) as busy:
            acquire(location(copy))
        message = str(busy.value)
        assert f"at {original} is held by {HOST} pid {holder.pid} " in message
        assert f"this state at {copy} is a copy of it" in message
    finally:
        _stop(holder)


def test_a_copy_of_a_released_state_continues_and_says_where_from(tmp_path):
    original, copy = tmp_path / "a", tmp_path / "b"
    holder = _hold(str(original), "--for", "0", "--release")
    assert holder.wait(timeout=60) == 0
    shutil.copytree(original, copy)
    run = acquire(location(copy))
    doc = current(location(copy))
    assert run.gen == 2
    assert doc["lineage"]["copied_from"] == f"{HOST}:{os.path.realpath(original)}"
    assert doc["home"] == f"{HOST}:{os.path.realpath(copy)}"
    assert current(location(original))["generation"] == 1


def test_wait_acquires_once_the_holder_releases(shared):
    holder = _hold(shared, "--for", "1", "--release")
    try:
        with pytest.raises(Busy):
            acquire(shared)
        run = acquire(shared, wait=True, poll=0.05)
        assert run.gen == 2
        assert holder.wait(timeout=60) == 0
        assert holder.stdout.read().split() == ["released"]
    finally:
        _stop(holder)


def test_a_temporary_control_file_a_killed_writer_left_goes_at_the_next_write(tmp_path):
    state = location(tmp_path / "state")
    run = acquire(state)
    folder = Path(state) / "runs" / run.id
    stray = folder / ".control.json.tmp-0123456789ab"  # SIGKILL between write and rename
    stray.write_bytes(b'{"half": ')
    other = folder / ".notes.tmp-0123456789ab"  # not a temporary file of the control object
    other.write_bytes(b"x")
    run.renew()
    assert not stray.exists() and other.exists()
    assert current(state)["generation"] == run.gen
