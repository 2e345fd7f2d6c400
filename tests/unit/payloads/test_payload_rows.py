"""Row segments: push boundaries, restore without loss or repeat, identity pinning, and the
pointer: a segment folder counts only while the run's ``rows`` pointer names it."""

from __future__ import annotations

import json
import logging

import pytest

from spill.control.control import Superseded
from spill.control.ownership import acquire
from spill.control.place import Place
from spill.payloads.rows import (
    IdentityMismatch,
    SegmentWriter,
    commit_markers,
    pin_identity,
)
from spill.payloads.rows import restore as _restore
from spill.store import fs
from spill.store.location import location


def writer(root: str, *args, **kwargs) -> SegmentWriter:
    """A writer in this process's run at ``root`` (acquired, as a row job with --state does)."""
    return SegmentWriter(acquire(root).place(), *args, **kwargs)


def restore(root: str):
    """What a reader (a fresh ``Place``, reading the control object) restores."""
    return _restore(Place(root))


def seg_files(root: str) -> list[str]:
    """Segment payload folders on disk (pointed or not)."""
    return [n for n in fs.listdir(fs.join(root, "payloads")) if n.startswith("rows-")]


def pointed(root: str) -> list[str]:
    return [u.rsplit("/", 1)[-1] for u in Place(root).pointer("rows")]


def add_rows(w: SegmentWriter, ids) -> list[bool]:
    return [w.add(f"r{i}", {"id": f"r{i}", "text": f"answer {i}\u2028ok"}) for i in ids]


def test_pushes_at_25_rows_and_on_close(root, identity, producer):
    w = writer(root, identity, producer)
    pushed = add_rows(w, range(24))
    assert not any(pushed) and seg_files(root) == []
    assert add_rows(w, range(24, 25)) == [True]
    assert seg_files(root) == ["rows-g1-s0-0"] and pointed(root) == ["rows-g1-s0-0"]
    assert fs.listdir(fs.join(root, "payloads", "rows-g1-s0-0")) == ["COMMIT", "rows.jsonl"]
    add_rows(w, range(25, 30))
    assert w.pending == 5
    w.close()
    assert seg_files(root) == ["rows-g1-s0-0", "rows-g1-s1-0"]
    assert pointed(root) == ["rows-g1-s1-0", "rows-g1-s0-0"]  # newest first
    commit = json.loads(fs.get_bytes(fs.join(root, "payloads", "rows-g1-s0-0", "COMMIT")))
    assert commit["count"] == 25 and commit["row_ids"] == [f"r{i}" for i in range(25)]
    assert commit["producer"] == producer
    assert [m["count"] for m in commit_markers(Place(root))] == [25, 5]  # oldest first
    rows, done = restore(root)
    assert done == [f"r{i}" for i in range(30)] and [r["id"] for r in rows] == done


def test_pushes_after_60_seconds(tmp_path, identity, producer):
    now = [0.0]
    root = location(tmp_path / "state")
    w = writer(root, identity, producer, clock=lambda: now[0])
    assert add_rows(w, range(2)) == [False, False]
    now[0] = 59.0
    assert not w.tick()
    now[0] = 60.0
    assert w.tick() and restore(root).done == ["r0", "r1"]
    assert not w.tick()  # nothing buffered


def test_continuing_writer_neither_loses_nor_repeats(root, identity, producer):
    run = acquire(root)
    with SegmentWriter(run.place(), identity, producer) as w:
        add_rows(w, range(30))
    w2 = SegmentWriter(run.place(), identity, producer)
    assert w2.done == {f"r{i}" for i in range(30)}
    with pytest.raises(ValueError, match="already done"):
        w2.add("r3", {})
    todo = [i for i in range(70) if f"r{i}" not in w2.done]
    add_rows(w2, todo)
    w2.close()
    rows, done = restore(root)
    assert done == [f"r{i}" for i in range(70)]
    assert rows[40] == {"id": "r40", "text": "answer 40\u2028ok"}


def test_a_segment_not_pointed_at_is_never_restored_and_the_next_push_removes_it(
    root, tmp_path, identity, producer, caplog
):
    """A complete segment folder with a valid COMMIT, of a higher number than any pointed one,
    that nobody published (a push killed before its publication leaves exactly this)."""
    run = acquire(root)
    with SegmentWriter(run.place(), identity, producer) as w:
        add_rows(w, range(25))
    other = location(tmp_path / "other")
    with writer(other, identity, producer, every_rows=1) as w:
        add_rows(w, range(25, 28))  # segments 0, 1, 2 there; segment 2 holds r27
    made = Place(other).pointer("rows")[0]
    stray = fs.join(root, "payloads", "rows-g1-s2-0")
    for name in fs.listdir(made):
        fs.put_bytes(fs.join(stray, name), fs.get_bytes(fs.join(made, name)))
    with caplog.at_level(logging.WARNING, logger="spill.payloads.rows"):
        assert restore(root).done == [f"r{i}" for i in range(25)]
    assert caplog.records == []  # nothing pointed failed
    assert [m["count"] for m in commit_markers(Place(root))] == [25]
    w = SegmentWriter(run.place(), identity, producer)
    assert "r27" not in w.done
    add_rows(w, range(25, 28))
    w.close()
    assert seg_files(root) == ["rows-g1-s0-0", "rows-g1-s1-0"]
    assert restore(root).done == [f"r{i}" for i in range(28)]


def test_damaged_segment_is_not_trusted_then_dropped(tmp_path, identity, producer, caplog):
    root = location(tmp_path / "state")
    run = acquire(root)
    with SegmentWriter(run.place(), identity, producer, every_rows=5) as w:
        add_rows(w, range(10))
    seg = fs.join(root, "payloads", "rows-g1-s0-0", "rows.jsonl")
    fs.put_bytes(seg, fs.get_bytes(seg).replace(b"answer 3", b"answer 9"))
    with caplog.at_level(logging.WARNING, logger="spill.payloads.rows"):
        assert restore(root).done == [f"r{i}" for i in range(5, 10)]
    assert any(
        "rows-g1-s0-0" in r.getMessage() and "sha256" in r.getMessage() for r in caplog.records
    )
    w = SegmentWriter(run.place(), identity, producer)
    add_rows(w, range(5))  # the damaged rows are redone
    w.close()
    assert sorted(restore(root).done) == sorted(f"r{i}" for i in range(10))
    assert pointed(root) == ["rows-g1-s2-0", "rows-g1-s1-0"]
    assert seg_files(root) == ["rows-g1-s1-0", "rows-g1-s2-0"]


def test_a_stale_writer_cannot_make_its_segment_current(root, identity, producer):
    """A row writer stopped past its lease is taken over; its next push writes its folder but
    the publication is fenced (Superseded): its rows are never restored, and the successor
    runs them itself."""
    stale = acquire(root, lease=0.2)  # no heartbeat: as if stopped past its lease
    w = SegmentWriter(stale.place(), identity, producer, every_rows=5)
    add_rows(w, range(5))
    fresh = acquire(root, wait=True, poll=0.05)
    assert fresh.gen == stale.gen + 1
    add_rows(w, range(5, 9))
    with pytest.raises(Superseded, match="generation 2"):
        add_rows(w, range(9, 10))  # the push of r5..r9
    assert "rows-g1-s1-0" in seg_files(root)  # written, never current
    assert restore(root).done == [f"r{i}" for i in range(5)]
    w2 = SegmentWriter(fresh.place(), identity, producer)
    assert w2.done == {f"r{i}" for i in range(5)}
    add_rows(w2, range(5, 10))
    w2.close()
    assert restore(root).done == [f"r{i}" for i in range(10)]
    assert pointed(root) == ["rows-g2-s1-0", "rows-g1-s0-0"]
    assert seg_files(root) == ["rows-g1-s0-0", "rows-g2-s1-0"]  # the stale folder collected


def test_identity_refusal_names_the_difference(root, identity, producer):
    pin_identity(root, identity)
    pin_identity(root, identity)  # same job: fine
    other = {**identity, "model": {**identity["model"], "fingerprint": "e" * 16}}
    with pytest.raises(IdentityMismatch) as e:
        writer(root, other, producer)
    msg = str(e.value)
    assert "\n" not in msg and "model.fingerprint" in msg and "eeee" in msg and "ffff" in msg
    with pytest.raises(IdentityMismatch, match="input.sha256"):
        pin_identity(root, {**identity, "input": {"sha256": "1" * 64}})
    assert fs.exists(fs.join(root, "rows", "identity.json"))  # where it always was


def test_producer_must_be_complete(tmp_path, identity):
    with pytest.raises(ValueError, match="numerics"):
        writer(location(tmp_path), identity, {"engine": "torch", "hardware": "cpu", "os": "linux"})
