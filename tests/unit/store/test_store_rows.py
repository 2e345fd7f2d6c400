"""Row segments: push boundaries, restore without loss or repeat, identity pinning."""

from __future__ import annotations

import json
import logging

import pytest

from spill.store import fs
from spill.store.rows import IdentityMismatch, SegmentWriter, pin_identity, restore


def seg_files(root: str) -> list[str]:
    return [n for n in fs.listdir(fs.join(root, "rows")) if n.startswith("seg-")]


def add_rows(w: SegmentWriter, ids: range) -> list[bool]:
    return [w.add(f"r{i}", {"id": f"r{i}", "text": f"answer {i}\u2028ok"}) for i in ids]


def test_pushes_at_25_rows_and_on_close(root, identity, producer):
    w = SegmentWriter(root, identity, producer)
    pushed = add_rows(w, range(24))
    assert not any(pushed) and seg_files(root) == []
    assert add_rows(w, range(24, 25)) == [True]
    assert seg_files(root) == ["seg-0.commit", "seg-0.jsonl"]
    add_rows(w, range(25, 30))
    assert w.pending == 5
    w.close()
    assert seg_files(root) == ["seg-0.commit", "seg-0.jsonl", "seg-1.commit", "seg-1.jsonl"]
    commit = json.loads(fs.get_bytes(fs.join(root, "rows", "seg-0.commit")))
    assert commit["count"] == 25 and commit["row_ids"] == [f"r{i}" for i in range(25)]
    assert commit["producer"] == producer
    rows, done = restore(root)
    assert done == [f"r{i}" for i in range(30)] and [r["id"] for r in rows] == done


def test_pushes_after_60_seconds(tmp_path, identity, producer):
    now = [0.0]
    root = str(tmp_path / "state")
    w = SegmentWriter(root, identity, producer, clock=lambda: now[0])
    assert add_rows(w, range(2)) == [False, False]
    now[0] = 59.0
    assert not w.tick()
    now[0] = 60.0
    assert w.tick() and restore(root).done == ["r0", "r1"]
    assert not w.tick()  # nothing buffered


def test_continuing_writer_neither_loses_nor_repeats(root, identity, producer):
    with SegmentWriter(root, identity, producer) as w:
        add_rows(w, range(30))
    w2 = SegmentWriter(root, identity, producer)
    assert w2.done == {f"r{i}" for i in range(30)}
    with pytest.raises(ValueError, match="already done"):
        w2.add("r3", {})
    todo = [i for i in range(70) if f"r{i}" not in w2.done]
    add_rows(w2, todo)
    w2.close()
    rows, done = restore(root)
    assert done == [f"r{i}" for i in range(70)]
    assert rows[40] == {"id": "r40", "text": "answer 40\u2028ok"}


def test_uncommitted_segment_is_ignored_then_removed_by_next_push(
    tmp_path, identity, producer, caplog
):
    root = str(tmp_path / "state")
    with SegmentWriter(root, identity, producer) as w:
        add_rows(w, range(25))
    fs.put_bytes(fs.join(root, "rows", "seg-1.jsonl"), b'{"id": "r25"}\n')  # died before .commit
    with caplog.at_level(logging.WARNING, logger="spill.store.rows"):
        assert restore(root).done == [f"r{i}" for i in range(25)]
    assert any("seg-1" in r.getMessage() and "no commit" in r.getMessage() for r in caplog.records)
    w = SegmentWriter(root, identity, producer)
    assert "r25" not in w.done
    add_rows(w, range(25, 27))
    w.close()
    assert seg_files(root) == ["seg-0.commit", "seg-0.jsonl", "seg-2.commit", "seg-2.jsonl"]
    assert restore(root).done == [f"r{i}" for i in range(27)]


def test_damaged_segment_is_not_trusted(tmp_path, identity, producer, caplog):
    root = str(tmp_path / "state")
    with SegmentWriter(root, identity, producer, every_rows=5) as w:
        add_rows(w, range(10))
    seg = fs.join(root, "rows", "seg-0.jsonl")
    fs.put_bytes(seg, fs.get_bytes(seg).replace(b"answer 3", b"answer 9"))
    with caplog.at_level(logging.WARNING, logger="spill.store.rows"):
        assert restore(root).done == [f"r{i}" for i in range(5, 10)]
    assert any("sha256" in r.getMessage() for r in caplog.records)
    w = SegmentWriter(root, identity, producer)
    add_rows(w, range(5))  # the damaged rows are redone
    w.close()
    assert sorted(restore(root).done) == sorted(f"r{i}" for i in range(10))
    assert "seg-0.jsonl" not in seg_files(root)


def test_identity_refusal_names_the_difference(root, identity, producer):
    pin_identity(root, identity)
    pin_identity(root, identity)  # same job: fine
    other = {**identity, "model": {**identity["model"], "fingerprint": "e" * 16}}
    with pytest.raises(IdentityMismatch) as e:
        SegmentWriter(root, other, producer)
    msg = str(e.value)
    assert "\n" not in msg and "model.fingerprint" in msg and "eeee" in msg and "ffff" in msg
    with pytest.raises(IdentityMismatch, match="input.sha256"):
        pin_identity(root, {**identity, "input": {"sha256": "1" * 64}})


def test_producer_must_be_complete(tmp_path, identity):
    with pytest.raises(ValueError, match="numerics"):
        SegmentWriter(
            str(tmp_path), identity, {"engine": "torch", "hardware": "cpu", "os": "linux"}
        )
