"""A location's runs as a whole (issue 19, item 4): a new run's generation is above every one in
use, and no collection removes what another run's control object points at.

On a local folder (a real flock), ``memory://`` and the S3 server over HTTP (conditional PUTs).
"""

from __future__ import annotations

import json
import logging

import pytest

from spill.control import place as place_mod
from spill.control.runs import acquire
from spill.store.fs import exists, get_bytes, join, listdir, put_bytes, remove

REBUILT = "spill.control.runlist"


def _raw(state: str, key: str) -> dict:
    return json.loads(get_bytes(join(state, "runs", key)))


def _payload(uri: str) -> str:
    put_bytes(join(uri, "MANIFEST"), b"{}")
    return uri


@pytest.mark.parametrize("how", ["runs deleted", "no runs yet"])
def test_a_new_runs_generation_is_above_every_payload_name(root, how):
    if how == "runs deleted":
        run = acquire(root)
        for _ in range(3):  # generation 4
            run.release()
            run = acquire(root)
        run.release()
        remove(join(root, "runs"))
    _payload(join(root, "stages", "tune", "payloads", "ckpt-g7-s2-0"))
    _payload(join(root, "payloads", "state-g3-s1-0"))
    new = acquire(root)
    assert new.gen == 8
    assert new.place("stages/tune").payload("ckpt", 2).endswith("/ckpt-g8-s2-0")


def test_an_attempt_number_is_never_reused(root):
    place = acquire(root).place("job")
    first = _payload(place.payload("ckpt", 1))
    second = _payload(place.payload("ckpt", 1))
    remove(first)  # collected: the name is not free again
    assert place.payload("ckpt", 1).endswith("/ckpt-g1-s1-2") and second.endswith("-1")


def test_a_collect_keeps_what_another_run_points_at_and_reads_a_finished_run_once(
    root, monkeypatch
):
    parent = acquire(root)
    old = _payload(parent.place("job").payload("ckpt", 4))
    parent.place("job").publish("ckpt", [old])
    parent.complete()
    child = acquire(root, new_run=True)  # starts from the parent's pointers
    assert child.gen == 2 and child.doc["pointers"] == parent.doc["pointers"]
    place = child.place("job")
    litter = _payload(place.payload("ckpt", 5))  # never published
    new = _payload(place.payload("ckpt", 6))
    place.publish("ckpt", [new])
    reads = []
    real = place_mod.read_control
    monkeypatch.setattr(place_mod, "read_control", lambda s, r: reads.append(r) or real(s, r))
    for _ in range(3):
        place.collect("ckpt", {new})
    assert exists(join(old, "MANIFEST")) and exists(join(new, "MANIFEST"))
    assert not exists(join(litter, "MANIFEST"))
    assert reads == [parent.id]  # complete: read once by this process, never again
    assert _raw(root, f"{parent.id}/control.json")["pointers"]["job/ckpt"] == [old[len(root) + 1 :]]


def test_clearing_a_place_spares_what_another_run_points_at(root):
    parent = acquire(root)
    old = _payload(parent.place("job").payload("ckpt", 4))
    parent.place("job").publish("ckpt", [old])
    parent.complete()
    child = acquire(root, new_run=True)
    put_bytes(join(root, "job", "rows", "identity.json"), b"{}")
    mine = _payload(child.place("job").payload("ckpt", 1))
    child.place("job").publish("ckpt", [mine])
    child.place("job").clear()
    assert "job/ckpt" not in child.doc["pointers"]
    assert exists(join(old, "MANIFEST"))
    assert not exists(join(mine, "MANIFEST"))
    assert listdir(join(root, "job")) == ["payloads"]
    assert listdir(join(root, "job", "payloads")) == [old.rsplit("/", 1)[1]]


def test_a_collect_that_cannot_read_another_control_object_removes_nothing(root, caplog):
    parent = acquire(root)
    parent.complete()
    child = acquire(root, new_run=True)
    litter = _payload(child.place().payload("ckpt", 1))
    put_bytes(join(root, "runs", parent.id, "control.json"), b"{")  # damaged
    with caplog.at_level(logging.WARNING, logger="spill.control.place"):
        child.place().collect("ckpt", set())
    assert exists(join(litter, "MANIFEST"))
    assert "not collected yet" in caplog.text and "is not JSON" in caplog.text
