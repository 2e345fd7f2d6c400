"""A move called off (``transfer.abort``) and the destination's claim (``spill.control.arrival``),
in process, on every backend.

* After each step before ``fence`` (the mover abandoned with a short lease), the abort returns
  the source to the status it had before the quiesce, released, at the next generation, with
  ``aborted`` and ``before`` in its transfer; the abandoned mover's next transition fails
  (fencing); the run is acquired as any run; ``remove_claim`` leaves nothing of the transfer at
  the destination but the lock file, and an abort run again changes nothing.
* Refusals: after ``fence`` (the destination may be active), a run held by a live mover, a run
  in no move, a destination's incoming run.
* The claim: a second move's claim of a claimed place is refused before its source changes; a
  claim left before the quiesce is adopted by the same move; a claim is abandoned once its
  mover is gone and its source does not stand under it (never while the source does), and
  ``check_destination`` removes it.
"""

from __future__ import annotations

import json
import secrets
import time

import pytest

from spill.control import arrival, transfer
from spill.control.control import Busy, Superseded
from spill.control.keys import current, store_for
from spill.control.owner import home_of
from spill.control.ownership import acquire
from spill.errors import StoreError, UsageError
from spill.store import drill
from spill.store.fs import files_under, join, put_bytes
from spill.store.location import location
from tests.unit.control.test_transfer import STEPS, _advance, _claim, _finish, _made


@pytest.mark.parametrize("upto", range(1, 6), ids=list(STEPS[:5]))
def test_an_abort_after_each_step_before_fence_returns_the_source(root, upto):
    src, dst = join(root, "src"), join(root, "dst")
    before = _made(src)
    tid = _advance(src, dst, upto, lease=0.2)
    put_bytes(join(dst, "job", "copied.bin"), b"part")  # as if the copy had begun
    manifest = {
        "schema_version": 1,
        "kind": "spill-move",
        "transfer": tid,
        "run": before["run"],
        "from": home_of(src),
        "to": dst,
        "project": False,
        "sealed": False,
        "files": [],
        "bytes": 0,
        "paths": ["job/copied.bin", "job/not-yet.bin"],
    }
    put_bytes(arrival.manifest_uri(dst, before["run"], tid), json.dumps(manifest).encode())
    left = current(src)
    time.sleep(0.25)  # the mover's lease runs out: it is abandoned
    seen: list[str] = []
    with drill.hooked(lambda b: b.startswith("move-") and seen.append(b)):
        done = transfer.abort(store_for(src))
    assert seen == ["move-abort"]
    assert current(src) == done
    assert done["status"] == "active" and done["owner"]["released"]
    assert done["generation"] == left["generation"] + 1
    assert done["pointers"] == before["pointers"]
    t = done["transfer"]
    assert t["id"] == tid and t["aborted"] and t["step"] == left["transfer"]["step"]
    assert t["before"] == {"status": "active", "generation": before["generation"], "released": True}
    assert transfer.describe_move(done).startswith(f"the move to {dst} was aborted at ")
    assert transfer.abort(store_for(src)) == done  # run again: nothing changes

    assert arrival.remove_claim(store_for(dst), dst, before["run"], tid)
    assert current(dst) is None
    assert [r for r in files_under(dst) if r != "runs/control.lock"] == []
    assert not arrival.remove_claim(store_for(dst), dst, before["run"], tid)  # gone already
    assert acquire(src).gen == done["generation"] + 1  # an ordinary run again


def test_an_aborted_source_fences_its_stale_mover(tmp_path):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    _made(src)
    s = store_for(src)
    tid = transfer.begin(s, dst, wait=False, tid=_claim(src, dst))["transfer"]["id"]
    run = transfer.take(s, tid, lease=0.2)  # a mover stopped past its lease
    arrival.incoming(store_for(dst), run.doc, step="take")
    time.sleep(0.25)
    done = transfer.abort(s)
    with pytest.raises(Superseded):
        transfer.step(run, "copy")
    assert current(src) == done


def test_an_abort_is_refused_after_fence_while_held_and_without_a_move(tmp_path):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    rid = _made(src)["run"]
    with pytest.raises(UsageError) as e:
        transfer.abort(store_for(src))
    assert str(e.value) == f"run {rid} at {src} is not in a move; nothing to abort"
    _advance(src, dst, 2)  # the mover holds the run (its lease running, this process alive)
    with pytest.raises(Busy) as e:
        transfer.abort(store_for(src))
    assert f"is held by {current(src)['owner']['host']} pid " in str(e.value)
    assert f"(the move to {dst}, step take done)" in str(e.value)
    with pytest.raises(StoreError) as e:
        transfer.abort(store_for(dst))
    assert "is arriving from" in str(e.value) and "abort the move at its source" in str(e.value)

    other, to = location(tmp_path / "other"), location(tmp_path / "to")
    _made(other)
    _advance(other, to, 6)
    with pytest.raises(StoreError) as e:
        transfer.abort(store_for(other))
    assert str(e.value).endswith(
        f"is transferred (its destination may be active already); finish the move to {to} by "
        "running the same `spill move` again"
    )
    assert current(other)["status"] == "transferred"


def test_a_claimed_place_refuses_a_second_move_before_its_source_changes(root):
    a, b, dst = join(root, "a"), join(root, "b"), join(root, "dst")
    _made(a)
    _made(b)
    tid = _claim(a, dst)
    theirs = current(b)
    with pytest.raises(arrival.Taken) as e:
        _claim(b, dst)
    assert str(e.value) == (
        f"{dst} holds a claim of another move (run {current(a)['run']} from {home_of(a)}, step "
        "claim done) now; move to a new or empty location"
    )
    assert current(b) == theirs and current(dst)["transfer"]["id"] == tid


def test_a_claim_left_before_the_quiesce_is_adopted_and_finished(tmp_path):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    _made(src)
    tid = _advance(src, dst, 0)  # claimed; the mover stopped before its quiesce
    assert current(src).get("transfer") is None
    assert _claim(src, dst) == tid
    assert _finish(src, dst)["transfer"]["id"] == tid


def test_an_abandoned_claim_is_removed_and_a_live_one_is_not(tmp_path):
    src, dst = location(tmp_path / "src"), location(tmp_path / "dst")
    _made(src)
    tid = _advance(src, dst, 1, lease=0.2)  # quiesced: the source stands under the claim
    time.sleep(0.25)
    claim = current(dst)
    assert not arrival.abandoned(claim)
    transfer.abort(store_for(src))
    assert arrival.abandoned(current(dst))  # its source was returned: nobody will finish it

    other = location(tmp_path / "other")
    _made(other)
    frm = home_of(other)
    gone = arrival.check_destination(store_for(dst), dst, current(other), frm, dst)
    assert [g["transfer"]["id"] for g in gone] == [tid] and current(dst) is None
    tid2, _ = arrival.claim(
        store_for(dst),
        current(other),
        secrets.token_hex(8),
        frm,
        dst,
        lease=120,
        nonce=secrets.token_hex(16),
    )
    assert current(dst)["transfer"]["id"] == tid2 and not arrival.abandoned(current(dst))
