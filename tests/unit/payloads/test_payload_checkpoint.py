"""Tune checkpoints: exact roundtrip on every backend, COMMIT semantics, keep-two, and the
pointer: a payload folder counts only while the run's control object names it."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
from safetensors.numpy import save as safetensors_save

from spill.control.control import Superseded
from spill.control.ownership import acquire
from spill.control.place import Place, payload_seq
from spill.errors import StoreError
from spill.ground.validate import SchemaInvalid
from spill.payloads.checkpoint import (
    CheckpointInvalid,
    latest_checkpoint,
    load_checkpoint,
    newest_commit,
    save_checkpoint,
    settle,
)
from spill.store import fs
from spill.store.location import location


def writer(root: str) -> Place:
    """This process's place in the run at ``root`` (acquired, as ``spill tune`` does)."""
    return acquire(root).place()


def latest(root: str):
    """What a reader (a fresh ``Place``, reading the control object) takes."""
    return latest_checkpoint(Place(root))


def on_disk(root: str) -> list[str]:
    """The checkpoint folders left once every save's background removal has finished."""
    settle()
    return [n for n in fs.listdir(fs.join(root, "payloads")) if n.startswith("ckpt-")]


def pointed(root: str) -> list[int]:
    return [payload_seq(u) for u in Place(root).pointer("ckpt")]


def assert_exact(loaded, expected) -> None:
    params, opt, state = expected
    assert list(loaded.params) == sorted(params) and list(loaded.opt) == sorted(opt)
    for got, want in ((loaded.params, params), (loaded.opt, opt)):
        for name, a in want.items():
            assert got[name].dtype == np.float32 and np.array_equal(got[name], a), name
    assert {k: v for k, v in loaded.state.items() if k != "schema_version"} == state


def test_roundtrip_is_exact(root, data):
    assert latest(root) is None and newest_commit(Place(root)) is None
    uri = save_checkpoint(writer(root), 7, *data(7))
    assert uri == fs.join(root, "payloads", "ckpt-g1-s7-0")
    assert sorted(fs.listdir(uri)) == [
        "COMMIT",
        "opt.safetensors",
        "params.safetensors",
        "state.json",
    ]
    ckpt = latest(root)
    assert ckpt is not None and ckpt.step == 7 and ckpt.uri == uri
    assert_exact(load_checkpoint(ckpt), data(7))
    assert_exact(load_checkpoint(ckpt), data(7))  # a second load reads the store again
    assert_exact(load_checkpoint(uri), data(7))
    step, state = newest_commit(Place(root))
    assert step == 7 and state["cursor"] == data(7)[2]["cursor"]


def test_bytes_are_deterministic(tmp_path, data):
    a, b = location(tmp_path / "a"), location(tmp_path / "b")
    params, opt, state = data(2)
    ua = save_checkpoint(writer(a), 2, params, opt, state)
    ub = save_checkpoint(
        writer(b), 2, dict(reversed(params.items())), dict(reversed(opt.items())), state
    )
    for name in ("params.safetensors", "opt.safetensors", "state.json", "COMMIT"):
        assert fs.get_bytes(fs.join(ua, name)) == fs.get_bytes(fs.join(ub, name))
    commit = json.loads(fs.get_bytes(fs.join(ua, "COMMIT")))
    assert commit["schema_version"] == 1 and set(commit["files"]) == {
        "params.safetensors",
        "opt.safetensors",
        "state.json",
    }
    # the layout safetensors itself writes (checkpoints of earlier versions were written by it)
    assert fs.get_bytes(fs.join(ua, "params.safetensors")) == safetensors_save(
        dict(sorted(params.items()))
    )


def test_a_view_is_written_as_its_values(tmp_path, data):
    """A transposed (non-contiguous) array is saved as the values it shows, not as its memory."""
    params, opt, state = data(1)
    name = sorted(params)[0]
    params = {**params, name: np.asfortranarray(params[name])}
    uri = save_checkpoint(writer(location(tmp_path / "s")), 1, params, opt, state)
    assert np.array_equal(load_checkpoint(uri).params[name], params[name])


def test_resaving_the_current_step_with_other_values_writes_a_new_folder(tmp_path, data):
    root = location(tmp_path / "state")
    place = writer(root)
    save_checkpoint(place, 1, *data(1))
    params, opt, state = data(2)
    first = save_checkpoint(place, 2, params, opt, state)
    other = {k: a + 1 for k, a in params.items()}
    again = save_checkpoint(place, 2, other, opt, state)
    assert again != first and again.endswith("ckpt-g1-s2-1")
    assert_exact(load_checkpoint(latest(root)), (other, opt, state))


def test_keeps_the_two_newest(root, data):
    place = writer(root)
    for step in (1, 2, 3, 4):
        save_checkpoint(place, step, *data(step))
    assert pointed(root) == [4, 3]  # newest first
    assert on_disk(root) == ["ckpt-g1-s3-0", "ckpt-g1-s4-0"]
    assert latest(root).step == 4


def test_a_folder_not_pointed_at_is_never_loaded_and_the_next_save_removes_it(root, tmp_path, data):
    """Recovery follows the pointer, never "the highest step folder": a complete, verifying
    folder of a higher step that the control object does not name is not a checkpoint."""
    place = writer(root)
    save_checkpoint(place, 1, *data(1))
    save_checkpoint(place, 2, *data(2))
    # a good step-9 checkpoint (made in another run) copied in by hand: nobody published it
    made = save_checkpoint(writer(location(tmp_path / "other")), 9, *data(9))
    stray = fs.join(root, "payloads", "ckpt-g1-s9-0")
    for name in fs.listdir(made):
        fs.put_bytes(fs.join(stray, name), fs.get_bytes(fs.join(made, name)))
    assert_exact(load_checkpoint(stray), data(9))  # its bytes and COMMIT are valid
    assert latest(root).step == 2 and newest_commit(Place(root))[0] == 2
    assert pointed(root) == [2, 1]
    save_checkpoint(place, 3, *data(3))
    assert on_disk(root) == ["ckpt-g1-s2-0", "ckpt-g1-s3-0"]
    assert latest(root).step == 3


def test_an_unpublished_save_is_ignored_then_removed_by_the_next_save(tmp_path, data, caplog):
    """A writer that died after its COMMIT but before publishing left a complete folder that is
    not current; the run continues from the pointed step and the next save collects it."""
    root = location(tmp_path / "state")
    run = acquire(root)
    place = run.place()
    save_checkpoint(place, 1, *data(1))
    save_checkpoint(place, 2, *data(2))
    pointer = run.doc["pointers"]["ckpt"]
    save_checkpoint(place, 3, *data(3), keep=3)  # keep=3: nothing removed yet
    run.publish({"ckpt": pointer})  # as if step 3's publication never happened
    fs.put_bytes(fs.join(root, "payloads", "ckpt-g1-s3-0", "state.json"), b"{}")  # never read
    with caplog.at_level(logging.WARNING, logger="spill.payloads.checkpoint"):
        assert latest(root).step == 2
    assert caplog.records == []  # nothing pointed failed, so nothing to say
    save_checkpoint(place, 3, *data(3))  # the continuing job saves step 3 anew
    assert pointed(root) == [3, 2]
    assert on_disk(root) == ["ckpt-g1-s2-0", "ckpt-g1-s3-1"]
    assert_exact(load_checkpoint(latest(root)), data(3))


@pytest.mark.parametrize("damage", ["no COMMIT", "truncate", "flip", "bad COMMIT"])
def test_a_damaged_pointed_checkpoint_is_skipped_with_a_message_then_dropped(
    tmp_path, data, caplog, damage
):
    root = location(tmp_path / "state")
    place = writer(root)
    for step in (1, 2):
        save_checkpoint(place, step, *data(step))
    two = Place(root).pointer("ckpt")[0]
    if damage == "no COMMIT":
        fs.remove(fs.join(two, "COMMIT"))
    elif damage == "bad COMMIT":
        fs.put_bytes(fs.join(two, "COMMIT"), b'{"schema_version": 1}')
    else:
        victim = fs.join(two, "opt.safetensors")
        blob = bytearray(fs.get_bytes(victim))
        if damage == "truncate":
            del blob[-4:]
        else:
            blob[-1] ^= 0xFF
        fs.put_bytes(victim, bytes(blob))
    with caplog.at_level(logging.WARNING, logger="spill.payloads.checkpoint"):
        assert latest(root).step == 1
    [line] = [r.getMessage() for r in caplog.records]
    assert "ckpt-g1-s2-0" in line
    assert {
        "no COMMIT": "no COMMIT",
        "bad COMMIT": "unreadable COMMIT",
        "truncate": "bytes, COMMIT says",
        "flip": "sha256",
    }[damage] in line
    with pytest.raises(CheckpointInvalid):
        load_checkpoint(two)
    # the continuing job saves step 2 again: the damaged one is dropped, step 1 is kept
    save_checkpoint(place, 2, *data(2))
    assert pointed(root) == [2, 1]
    assert on_disk(root) == ["ckpt-g1-s1-0", "ckpt-g1-s2-1"]
    save_checkpoint(place, 3, *data(3))
    assert pointed(root) == [3, 2] and latest(root).step == 3


def test_a_damaged_older_checkpoint_is_not_kept_in_place_of_a_good_one(tmp_path, data):
    root = location(tmp_path / "state")
    place = writer(root)
    for step in (1, 2):
        save_checkpoint(place, step, *data(step))
    older = Place(root).pointer("ckpt")[1]
    fs.remove(fs.join(older, "COMMIT"))
    save_checkpoint(place, 3, *data(3))
    assert pointed(root) == [3, 2]  # not [3, 1]: step 1 no longer verifies
    assert on_disk(root) == ["ckpt-g1-s2-0", "ckpt-g1-s3-0"]


def test_resaving_the_current_step_is_a_no_op(tmp_path, data):
    root = location(tmp_path / "state")
    place = writer(root)
    save_checkpoint(place, 1, *data(1))
    uri = save_checkpoint(place, 2, *data(2))
    before = fs.get_bytes(fs.join(uri, "COMMIT"))
    assert save_checkpoint(place, 2, *data(2)) == uri
    assert fs.get_bytes(fs.join(uri, "COMMIT")) == before
    assert pointed(root) == [2, 1] and on_disk(root) == ["ckpt-g1-s1-0", "ckpt-g1-s2-0"]


def test_a_stale_writer_cannot_make_its_checkpoint_current(root, data):
    """A writer stopped past its lease is taken over (generation 2); its next save writes its
    folder but the publication is fenced (Superseded), and no reader ever loads that folder.
    The successor's saves never remove what a later generation wrote, only older litter."""
    stale = acquire(root, lease=0.2)  # no heartbeat: as if stopped past its lease
    save_checkpoint(stale.place(), 1, *data(1))
    fresh = acquire(root, wait=True, poll=0.05)  # waits for the lease to expire
    assert fresh.gen == stale.gen + 1
    with pytest.raises(Superseded, match="generation 2"):
        save_checkpoint(stale.place(), 5, *data(5))
    assert "ckpt-g1-s5-0" in on_disk(root)  # written, never current
    assert latest(root).step == 1 and pointed(root) == [1]
    with pytest.raises(Superseded):  # and it stays fenced
        save_checkpoint(stale.place(), 6, *data(6))
    save_checkpoint(fresh.place(), 2, *data(2))
    assert pointed(root) == [2, 1]
    assert on_disk(root) == ["ckpt-g1-s1-0", "ckpt-g2-s2-0"]  # the stale folders collected
    assert_exact(load_checkpoint(latest(root)), data(2))


def test_a_stale_collection_never_removes_a_later_generations_folder(tmp_path, data):
    """A writer paused between its publication and its removals, taken over meanwhile: when it
    goes on it removes only its own generation's folders that its pointer does not name, so
    nothing the successor wrote or points at goes."""
    root = location(tmp_path / "state")
    old = acquire(root, lease=0.2)
    one = save_checkpoint(old.place(), 1, *data(1))
    settle()
    fs.put_bytes(fs.join(root, "payloads", "ckpt-g1-s2-0", "params.safetensors"), b"x")  # litter
    new = acquire(root, wait=True, poll=0.05)
    save_checkpoint(new.place(), 2, *data(2))
    assert on_disk(root) == ["ckpt-g1-s1-0", "ckpt-g2-s2-0"]
    fs.put_bytes(fs.join(root, "payloads", "ckpt-g2-s3-0", "params.safetensors"), b"y")
    old.place().collect("ckpt", {one})  # the old writer's removals, after its publication
    assert on_disk(root) == ["ckpt-g1-s1-0", "ckpt-g2-s2-0", "ckpt-g2-s3-0"]
    assert pointed(root) == [2, 1] and latest(root).step == 2


def test_bad_inputs_are_refused_before_writing(tmp_path, data):
    root = location(tmp_path / "state")
    place = writer(root)
    params, opt, state = data(1)
    with pytest.raises(ValueError, match="float32"):
        save_checkpoint(place, 1, {**params, "x": np.zeros(2, np.float64)}, opt, state)
    with pytest.raises(ValueError, match="m::<param>"):
        save_checkpoint(place, 1, params, {**opt, "w::x": np.zeros(2, np.float32)}, state)
    with pytest.raises(ValueError, match="step 1"):
        save_checkpoint(place, 2, params, opt, state)
    with pytest.raises(SchemaInvalid, match="cursor"):
        save_checkpoint(place, 1, params, opt, {**state, "cursor": -1})
    assert on_disk(root) == [] and pointed(root) == []


def test_a_folder_name_that_is_not_a_payload_is_refused(tmp_path):
    with pytest.raises(CheckpointInvalid, match="not a payloads/ckpt"):
        load_checkpoint(str(tmp_path / "ckpt" / "step-1"))


def test_a_state_inside_another_runs_location_is_refused(root, data):
    """A build's stage folder is the build's run's: a run of its own there would name its
    folders like the build's (generations counted apart) and collect them."""
    place = acquire(root).place("stages/tune")
    made = save_checkpoint(place, 1, *data(1))
    assert made == fs.join(root, "stages", "tune", "payloads", "ckpt-g1-s1-0")
    with pytest.raises(StoreError, match="lies inside") as e:
        acquire(fs.join(root, "stages", "tune"))
    assert "\n" not in str(e.value) and "another --state" in str(e.value)
    assert latest_checkpoint(Place(root, "stages/tune")).uri == made
    assert not fs.exists(fs.join(root, "stages", "tune", "runs", "current.json"))
