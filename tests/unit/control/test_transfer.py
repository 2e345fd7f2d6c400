"""The control steps of a move (``spill.control.transfer`` at the source, ``spill.control.
arrival`` at the destination), in process, on every backend.

The claim and the seven steps in order (each reaching its drill point once), a rerun after each
step (the interrupted mover abandoned with a short lease, the way a mover killed on another
machine would be left), ``describe_move`` at every status, and the refusals: ``acquire`` of a
run mid-move at either place, a second destination, a held run without ``--wait``, a copy, a
location without a run, a destination holding another run, and a transfer id that is not the
destination's. The abort after each step before ``fence`` (the source returned at a new
generation, the claim removed; a stale mover fenced), its refusals, a claim's adoption and an
abandoned claim. What is copied between the steps is ``spill.project.move.move``'s
(tests/unit/project/move/test_move.py); real processes and SIGKILL are tests/func/test_move.py.
"""

from __future__ import annotations

import json
import secrets
import threading
import time

import pytest

from spill.control import arrival, transfer
from spill.control.control import Busy
from spill.control.keys import CURRENT, RUNS, current, store_for
from spill.control.owner import home_of, lease_seconds
from spill.control.ownership import CopiedRun, acquire, as_copy
from spill.errors import EXIT_PREEMPTED, StoreError
from spill.store import drill
from spill.store.fs import join, put_bytes
from spill.store.location import location

STEPS = transfer.STEPS


def _made(state: str) -> dict:
    """A released run at ``state`` with one pointer, as a stopped job leaves it."""
    run = acquire(state)
    run.publish({"job/ckpt": ["job/payloads/ckpt-g1-s2-0"]})
    run.release()
    return current(state)


@pytest.fixture
def places(root) -> tuple[str, str]:
    """A source with a stopped run, and an empty destination, on the ``root`` backend."""
    src, dst = join(root, "src"), join(root, "dst")
    _made(src)
    return src, dst


def _claim(src: str, dst: str, lease: float | None = None) -> str:
    """The destination's claim, as ``spill move`` makes it before the quiesce: its transfer id."""
    doc = current(src)
    was = transfer.pending(doc)
    tid, _ = arrival.claim(
        store_for(dst),
        doc,
        was["id"] if was else secrets.token_hex(8),
        home_of(src),
        dst,
        lease=lease_seconds(lease),
        nonce=secrets.token_hex(16),
    )
    return tid


def _advance(src: str, dst: str, upto: int, lease: float | None = None) -> str:
    """The claim, then steps 1..``upto`` by a mover that then stops without releasing; the
    transfer id."""
    s, d = store_for(src), store_for(dst)
    tid = _claim(src, dst, lease)
    if upto == 0:
        return tid
    tid = transfer.begin(s, dst, wait=False, tid=tid)["transfer"]["id"]
    if upto == 1:
        return tid
    run = transfer.take(s, tid, lease=lease)
    if upto == 2:
        return tid
    arrival.incoming(d, run.doc, step="take")  # the claim confirmed, before any file lands
    for n, name in enumerate(STEPS[2:6], start=3):
        if n > upto:
            return tid
        if name == "incoming":
            arrival.incoming(d, run.doc)
        if name == "fence":
            transfer.fence(run)
        else:
            transfer.step(run, name)
    if upto == 7:
        arrival.activate(d, tid)
    return tid


def _finish(src: str, dst: str) -> dict:
    """What a rerun of ``spill move`` does with the control objects (``move.move``)."""
    s, d = store_for(src), store_for(dst)
    doc = current(src)
    if doc["status"] != "transferred":
        doc = transfer.begin(s, dst, wait=False, tid=_claim(src, dst))
    tid = doc["transfer"]["id"]
    if doc["status"] == "quiescing":
        run = transfer.take(s, tid, lease=None)
        try:
            arrival.incoming(d, run.doc, step="take")
            transfer.step(run, "copy")
            transfer.step(run, "verify")
            arrival.incoming(d, run.doc)
            transfer.step(run, "incoming")
            transfer.fence(run)
        finally:
            run.release()
    return arrival.activate(d, tid)


def test_the_seven_steps_in_order_hand_the_run_over(places):
    src, dst = places
    before = current(src)
    seen: list[str] = []
    with drill.hooked(lambda b: b.startswith("move-") and seen.append(b)):
        tid = _advance(src, dst, 7)
    assert seen == ["move-claim", *(f"move-{s}" for s in STEPS)]
    here, there = current(src), current(dst)
    assert here["status"] == "transferred" and here["owner"]["released"]
    t = here["transfer"]
    assert (t["id"], t["from"], t["to"], t["step"]) == (tid, home_of(src), dst, "fence")
    assert there["status"] == "active" and there["owner"]["released"]
    assert there["transfer"]["step"] == "activate" and there["transfer"]["id"] == tid
    assert there["home"] == home_of(dst) and here["home"] == before["home"]
    assert there["run"] == before["run"] and there["pointers"] == before["pointers"]
    assert there["generation"] == here["generation"] == before["generation"] + 1
    runs = json.loads(store_for(dst).read(CURRENT)[0])
    assert runs["current"] == before["run"] and runs["runs"] == [before["run"]]
    # the destination is an ordinary run now: acquired at the next generation
    assert acquire(dst).gen == before["generation"] + 2


@pytest.mark.parametrize("upto", range(1, 8), ids=list(STEPS))
def test_a_rerun_after_each_step_finishes_the_same_transfer(tmp_path, upto):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    before = _made(src)
    tid = _advance(src, dst, upto, lease=0.2)  # abandoned: its lease runs out in 0.2 s
    left = current(src)
    assert left["transfer"]["id"] == tid and left["transfer"]["step"] == STEPS[min(upto, 6) - 1]
    t0 = time.monotonic()
    done = _finish(src, dst)
    assert time.monotonic() - t0 < 5
    here = current(src)
    assert done["status"] == "active" and done["transfer"]["id"] == tid
    assert here["status"] == "transferred" and here["transfer"]["id"] == tid
    assert done["pointers"] == before["pointers"]
    takes = 0 if upto == 1 else 1  # the interrupted mover's take, then the rerun's (if any)
    takes += 1 if upto <= 5 else 0
    assert here["generation"] == before["generation"] + takes == done["generation"]


def test_describe_move_says_where_a_run_is_going_and_where_it_went(tmp_path):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    _made(src)
    assert transfer.describe_move(current(src)) is None
    _advance(src, dst, 2, lease=0.2)
    assert transfer.describe_move(current(src)) == f"moving to {dst}: step 2 of 7 (take) done"
    assert transfer.step_number("take") == 2 and transfer.step_number("activate") == 7
    time.sleep(0.25)
    s, d = store_for(src), store_for(dst)
    tid = current(src)["transfer"]["id"]
    run = transfer.take(s, tid, lease=None)
    arrival.incoming(d, run.doc, step="take")
    frm = home_of(src)
    assert transfer.describe_move(current(dst)) == f"moving from {frm}: step 2 of 7 (take) done"
    arrival.incoming(d, run.doc)
    transfer.step(run, "incoming")
    assert transfer.describe_move(current(src)) == f"moving to {dst}: step 5 of 7 (incoming) done"
    assert transfer.describe_move(current(dst)) == f"moving from {frm}: step 5 of 7 (incoming) done"
    transfer.fence(run)
    at = current(src)["transfer"]["at"]
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    assert transfer.describe_move(current(src)) == f"moved to {dst} at {iso}; continue there"
    arrival.activate(d, tid)
    iso = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(current(dst)["transfer"]["at"]))
    assert transfer.describe_move(current(dst)) == f"moved here from {frm} at {iso}"


def test_acquire_refuses_a_run_mid_move_at_either_place_in_one_line(tmp_path):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    rid = _made(src)["run"]
    _advance(src, dst, 1)
    with pytest.raises(StoreError) as e:
        acquire(src, wait=True)  # a refusal, not a wait: it returns at once
    assert str(e.value) == (
        f"run {rid} at {src} is being moved to {dst} (step quiesce done); run the same "
        "`spill move` again to finish it, or `spill move --abort` to call it off"
    )
    s, d = store_for(src), store_for(dst)
    run = transfer.take(s, current(src)["transfer"]["id"], lease=None)
    for claim in ("claim", "take", "incoming"):  # claimed first, confirmed after take, verify
        if claim != "claim":
            arrival.incoming(d, run.doc, step=claim)
        with pytest.raises(StoreError) as e:
            acquire(dst)
        assert str(e.value) == (
            f"run {rid} at {dst} is arriving from {home_of(src)} (a move, step {claim}); run "
            "the same `spill move` again to finish it"
        )
    transfer.fence(run)
    run.release()  # released already by the fence: nothing changes
    with pytest.raises(StoreError) as e:
        acquire(src)
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(current(src)["transfer"]["at"]))
    assert str(e.value) == f"run {rid} moved to {dst} at {at}; continue there"


def test_a_held_run_is_busy_without_wait_and_stops_for_a_move_with_it(tmp_path):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    held = acquire(src)  # a live writer: this process, its lease running
    with pytest.raises(Busy) as e:
        transfer.begin(store_for(src), dst, wait=False)
    assert e.value.exit_code == EXIT_PREEMPTED
    assert "; add --wait to stop it at its next committed boundary" in str(e.value)
    assert current(src)["status"] == "active" and current(src).get("transfer") is None

    asked: list[dict] = []
    held.on_quiesce = asked.append
    doc = transfer.begin(store_for(src), dst, wait=True)
    assert doc["status"] == "quiescing" and not asked
    held.renew()  # the writer's next transition notices the move, once
    held.renew()
    assert [d["status"] for d in asked] == ["quiescing"]
    taken: list = []
    mover = threading.Thread(
        target=lambda: taken.append(
            transfer.take(store_for(src), doc["transfer"]["id"], lease=None)
        )
    )
    mover.start()
    time.sleep(0.3)
    assert not taken, "the mover took the run while its writer still held it"
    held.release()  # the writer stopped at its committed boundary
    mover.join(timeout=10)
    assert taken and taken[0].gen == held.gen + 1


def test_a_second_destination_is_refused_until_the_first_move_is_finished(tmp_path):
    src, dst, other = (location(tmp_path / n) for n in ("src", "dst", "other"))
    _made(src)
    tid = _advance(src, dst, 1)
    again = transfer.begin(store_for(src), dst, wait=False)
    assert again["transfer"]["id"] == tid  # the same place: the same transfer continues
    for upto in (1, 6):
        if upto == 6:
            _finish(src, dst)
        with pytest.raises(StoreError) as e:
            transfer.begin(store_for(src), other, wait=False)
        more = ", or `spill move --abort` to call it off" if upto == 1 else ""
        assert str(e.value).endswith(
            f"is being moved (or was moved) to {dst}, not {other}; run `spill move` to {dst} "
            f"to finish it{more}"
        )


def test_a_run_that_is_arriving_cannot_be_moved_on(tmp_path):
    src, dst, other = (location(tmp_path / n) for n in ("src", "dst", "other"))
    _made(src)
    _advance(src, dst, 5)
    with pytest.raises(StoreError) as e:
        transfer.begin(store_for(dst), other, wait=False)
    assert f"is itself arriving from {home_of(src)}; finish that move first" in str(e.value)


def test_take_refuses_a_run_that_left_the_move(tmp_path):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    _made(src)
    tid = _advance(src, dst, 6)
    with pytest.raises(StoreError) as e:
        transfer.take(store_for(src), tid, lease=None)
    assert "left the move (status transferred); run `spill move` again" in str(e.value)


def test_incoming_refuses_a_destination_holding_another_run(tmp_path):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    _made(src)
    theirs = _made(dst)["run"]
    before = current(src)
    with pytest.raises(arrival.Taken) as e:
        _advance(src, dst, 5)
    assert str(e.value) == (
        f"{dst} holds run {theirs} (active) now; move to a new or empty location"
    )
    assert current(dst)["run"] == theirs and current(dst)["status"] == "active"
    assert current(src) == before  # refused by the claim, before the source changed


def test_activate_refuses_another_transfer(tmp_path):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    _made(src)
    _advance(src, dst, 5)
    with pytest.raises(StoreError) as e:
        arrival.activate(store_for(dst), "0123456789abcdef")
    assert "of another move" in str(e.value)
    assert current(dst)["status"] == "incoming"


def test_begin_refuses_a_copy_and_a_location_without_a_run_and_leaves_a_complete_run(tmp_path):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    with pytest.raises(StoreError) as e:
        transfer.begin(store_for(src), dst, wait=False)
    assert str(e.value) == f"nothing to move at {src}: it holds no run"

    doc = _made(src)
    copy, runs = as_copy(doc, src)
    put_bytes(join(src, RUNS, doc["run"], "control.json"), json.dumps(copy).encode())
    put_bytes(join(src, RUNS, CURRENT), json.dumps(runs).encode())
    with pytest.raises(CopiedRun) as e:
        transfer.begin(store_for(src), dst, wait=False)
    assert "is an installed copy; move the original" in str(e.value)
    assert current(src) == copy

    done = location(tmp_path / "done")
    run = acquire(done)
    run.complete()
    before = current(done)
    assert transfer.begin(store_for(done), dst, wait=False) == before  # copied, not fenced
    assert current(done) == before


def test_check_destination_accepts_an_empty_place_or_the_same_move_only(tmp_path):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    _made(src)
    frm, d = home_of(src), store_for(dst)
    assert arrival.check_destination(d, dst, current(src), frm, dst) == []  # nothing there
    _advance(src, dst, 3)  # claimed, partly copied
    put_bytes(join(dst, "job", "copied.bin"), b"part")
    assert arrival.check_destination(d, dst, current(src), frm, dst) == []  # the same move
    with pytest.raises(arrival.Taken) as e:
        arrival.check_destination(d, dst, current(src), frm, str(tmp_path / "elsewhere"))
    assert str(e.value) == (
        f"{dst} holds a claim of another move (run {current(src)['run']} from {frm}, step take "
        "done); move to a new or empty location"
    )
    other = location(tmp_path / "other")
    put_bytes(join(other, "mine.txt"), b"x")
    with pytest.raises(arrival.Taken) as e:
        arrival.check_destination(store_for(other), other, current(src), frm, other)
    assert str(e.value) == f"{other} is not empty (mine.txt, ...); move to a new or empty location"
