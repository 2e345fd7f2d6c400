"""A location's runs as a whole (issue 19, item 4): a lost run list is rebuilt from the control
objects (or refused in one line), a new run's generation is above every one in use, and no
collection removes what another run's control object points at.

On a local folder (a real flock), ``memory://`` and the S3 server over HTTP (conditional PUTs).
"""

from __future__ import annotations

import calendar
import json
import logging
import socket
import threading
import time

import pytest

from spill.control import keys
from spill.control import place as place_mod
from spill.control.control import Busy, Ownership, RunComplete
from spill.control.keys import CURRENT, UnclearRuns, current, restore, run_list, store_for
from spill.control.owner import home_of, me
from spill.control.ownership import _fresh, acquire
from spill.store.fs import exists, get_bytes, join, listdir, put_bytes, remove
from spill.store.location import location
from tests.conftest import bucket_uri

REBUILT = "spill.control.keys"


def _raw(state: str, key: str) -> dict:
    return json.loads(get_bytes(join(state, "runs", key)))


def _drop_list(state: str) -> None:
    remove(join(state, "runs", CURRENT))
    assert not exists(join(state, "runs", CURRENT))


def _payload(uri: str) -> str:
    put_bytes(join(uri, "MANIFEST"), b"{}")
    return uri


def _other_run(state: str, rid: str, *, used: bool, created: str | None = None) -> dict:
    """A second run's control object at ``state``, made as a racing first build would (its only
    transition the create) or, ``used``, released after that."""
    store = store_for(state)
    doc = _fresh(rid, me("ab" * 16), 60.0, home_of(state), None, {}, 1)
    if created:  # made then: its create too
        doc["created"] = created
        doc["last"]["at"] = calendar.timegm(time.strptime(created, "%Y-%m-%dT%H:%M:%SZ"))
    with store.exclusive():
        store.put(f"{rid}/control.json", doc, "control", None)
    if used:
        Ownership(store, doc, 60.0).release()
    return _raw(state, f"{rid}/control.json")


def test_a_lost_run_list_is_read_from_the_control_objects_and_written_by_the_next_acquire(
    root, caplog
):
    first = acquire(root)
    first.complete()
    second = acquire(root, new_run=True)
    second.release()
    want = _raw(root, CURRENT)
    assert want["runs"] == [first.id, second.id]
    _drop_list(root)
    assert current(root)["run"] == second.id  # the readers' view ...
    assert not exists(join(root, "runs", CURRENT))  # ... writes nothing
    with caplog.at_level(logging.WARNING, logger=REBUILT):
        again = acquire(root)
    assert again.id == second.id and again.gen == second.gen + 1
    assert _raw(root, CURRENT) == want  # the lineage orders runs made in the same second
    (line,) = [r.getMessage() for r in caplog.records if r.name == REBUILT]
    assert line.startswith(f"{join(root, 'runs', CURRENT)} was missing; rebuilt from the control ")
    assert f"objects of 2 runs: current is run {second.id} (active, generation 2, " in line


def test_with_every_run_finished_the_newest_is_current(root):
    first = acquire(root)
    first.complete()
    second = acquire(root, new_run=True)
    second.complete()
    want = _raw(root, CURRENT)
    _drop_list(root)
    assert current(root)["run"] == second.id
    with pytest.raises(RunComplete, match=f"run {second.id} at "):
        acquire(root)
    assert _raw(root, CURRENT) == want
    child = acquire(root, new_run=True)  # the next run forks from the newest, as before
    assert current(root)["lineage"]["parent"] == second.id and child.gen == 3


def test_two_unfinished_runs_without_a_run_list_are_refused_in_one_line(root):
    run = acquire(root)
    run.release()
    other = _other_run(root, "20000101-000000-abcdef", used=True)
    _drop_list(root)
    for attempt in (lambda: current(root), lambda: acquire(root)):
        with pytest.raises(UnclearRuns) as e:
            attempt()
        line = str(e.value)
        assert "\n" not in line and "more than one run there is unfinished" in line
        assert f"{run.id} (active, generation 1, " in line and f"{other['run']} (active" in line
        assert f"move the others' folders out of {join(root, 'runs')}" in line
    assert not exists(join(root, "runs", CURRENT))


@pytest.mark.parametrize("then", ["released", "complete"])
def test_a_run_that_was_created_and_never_used_gives_way(root, then):
    run = acquire(root)
    if then == "released":
        run.release()
    else:
        run.complete()
    # a racing first build that lost (made earlier: the list puts it first)
    _other_run(root, "20000101-000000-abcdef", used=False, created="2000-01-01T00:00:00Z")
    _drop_list(root)
    assert current(root)["run"] == run.id
    if then == "released":
        assert acquire(root).id == run.id
    else:
        with pytest.raises(RunComplete):
            acquire(root)
    assert _raw(root, CURRENT)["runs"] == ["20000101-000000-abcdef", run.id]


def test_two_runs_never_used_and_nothing_else_are_refused(root):
    for rid in ("20000101-000000-aaaaaa", "20000101-000000-bbbbbb"):  # left by two killed builds
        _other_run(root, rid, used=False, created="2000-01-01T00:00:00Z")
    with pytest.raises(UnclearRuns, match="more than one run there is unfinished"):
        acquire(root)
    assert not exists(join(root, "runs", CURRENT))


@pytest.mark.parametrize("where", ["s3", "gs", "az"])
def test_first_runs_being_started_on_an_object_store_are_waited_for(where, request, monkeypatch):
    """The gs eight-racer flake (issue 26): two first builds have each made their run's control
    object and neither has written the list yet; a third racer must wait for the list (then
    lose to its run's owner, exit 75), not refuse "more than one run there is unfinished"."""
    state = join(location(bucket_uri(request, where)), "state")
    a, b = "20000101-000000-aaaaaa", "20000101-000000-bbbbbb"
    for rid in (a, b):
        _other_run(state, rid, used=False)  # made just now by a live owner (this process)
    store = store_for(state)
    lister = threading.Timer(0.5, lambda: store.put(CURRENT, run_list([a]), "runs", None))
    t0 = time.monotonic()
    lister.start()
    with pytest.raises(Busy) as e:
        acquire(state)
    lister.join()
    assert 0.4 < time.monotonic() - t0 < keys.START_WAIT
    assert f"run {a} at {state} is held by {socket.gethostname()} pid " in str(e.value)
    assert _raw(state, CURRENT)["runs"] == [a]

    # a list that never comes: after START_WAIT the runs are what a lost list left (refused)
    monkeypatch.setattr(keys, "START_WAIT", 0.3)
    other = join(location(bucket_uri(request, where)), "other")
    for rid in (a, b):
        _other_run(other, rid, used=False)
    time.sleep(0.3)
    with pytest.raises(UnclearRuns, match="more than one run there is unfinished"):
        acquire(other)


def test_finished_runs_made_in_the_same_second_are_refused(root):
    for rid in ("20000101-000000-aaaaaa", "20000101-000000-bbbbbb"):
        _other_run(root, rid, used=True, created="2000-01-01T00:00:00Z")
        store = store_for(root)
        doc = _raw(root, f"{rid}/control.json")
        doc.update(status="complete", seq=doc["seq"] + 1)
        with store.exclusive():
            _, tag = store.read(f"{rid}/control.json")
            store.put(f"{rid}/control.json", doc, "control", tag)
    with pytest.raises(UnclearRuns, match="newest runs were made in the same second"):
        current(root)


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


def test_two_rebuilders_one_creates_the_list_the_other_reads_it(root, caplog):
    """The rebuild's create is conditional (the flock's check locally, If-None-Match on S3): a
    rebuilder that loses the race reads what the winner wrote and says nothing."""
    run = acquire(root)
    run.release()
    want = _raw(root, CURRENT)
    _drop_list(root)
    mine, theirs = store_for(root), store_for(root)
    real = mine.put

    def late(key, doc, schema, tag):
        if key == CURRENT:  # the other rebuilder creates it first
            assert restore(theirs)[0] == want
        return real(key, doc, schema, tag)

    mine.put = late
    with caplog.at_level(logging.WARNING, logger=REBUILT):
        got, tag = restore(mine)
    assert got == want and tag is not None
    assert len([r for r in caplog.records if r.name == REBUILT]) == 1  # the winner's line
    assert _raw(root, CURRENT) == want
