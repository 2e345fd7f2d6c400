"""Uncertain outcomes on S3: a control write lands but its answer is lost, and the writer
resolves it by reading again, with no lost and no doubled transition.

Between s3fs and the S3 server sits a real HTTP proxy (``s3_fault_proxy``) that forwards a
control PUT, lets the server apply it, and then closes or resets the client's connection, or
answers 503. Each transition (the first run's control object and ``runs/current.json``, the
acquisition of a released run, renew, publish, complete, release) is run under each fault, two
ways:

* default retries: the client retries by itself (aiohttp on a reused connection, botocore,
  s3fs); the retried conditional PUT gets a 412, and the transition reads again;
* retries off (``AWS_MAX_ATTEMPTS=1``, s3fs ``retries = 1``, and aiohttp's one retry dropped
  too): the write is ``Uncertain`` in ``spill.store.cas.objects``, and ``_transact`` (or
  ``acquire``) recognises its own landed write by ``last.op``.

The server's side is counted by the proxy: exactly one write of the control key landed per
transition (status 200), the faulted one.
"""

from __future__ import annotations

import json
import logging
import random
import uuid

import pytest

from spill.control import keys
from spill.control.ownership import acquire
from spill.store.fs import filesystem, get_bytes, join
from spill.store.location import location
from tests.func import s3_fault_proxy
from tests.func import tune_kit as kit

FAULTS = ("close", "reset", "503")
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
TRANSITIONS = (
    "create-control",
    "create-current",
    "acquire-released",
    "renew",
    "publish",
    "complete",
    "release",
)


@pytest.fixture(scope="module")
def proxy(s3_endpoint):
    p = s3_fault_proxy.start(s3_endpoint)
    yield p
    p.stop()


@pytest.fixture(scope="module", params=["retries", "no-retries"])
def mode(request, proxy):
    """s3fs pointed at the proxy, with its default retries or none; one client per mode (a
    module fixture, so tests run grouped by mode and do not pay a client each)."""
    import s3fs

    with pytest.MonkeyPatch.context() as mp:
        for name, value in S3_ENV.items():
            mp.setenv(name, value)
        mp.setenv("AWS_ENDPOINT_URL", proxy.url)
        if request.param == "no-retries":
            mp.setenv("AWS_MAX_ATTEMPTS", "1")
            mp.setattr(s3fs.S3FileSystem, "retries", 1)
        s3fs.S3FileSystem.clear_instance_cache()
        yield request.param
        s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture
def state(proxy, mode) -> str:
    """``s3://<a fresh bucket>/state``, reached through the proxy. Every bucket's name holds
    "412": a client error naming the bucket once passed for a 412 (a refused write)."""
    bucket = f"spill-412-{uuid.uuid4().hex[:8]}"
    filesystem(f"s3://{bucket}")[0].mkdir(bucket)
    proxy.clear()
    yield f"s3://{bucket}/state"
    proxy.clear()


def arm(proxy, part: str, fault: str, mode: str) -> None:
    """Fault the next PUT of ``part``; without retries also aiohttp's one retry of it on a
    reused connection, so that the client really sees no answer."""
    if fault == "503":
        proxy.fail_next_put(part)
    else:
        proxy.drop_next_put(part, n=2 if mode == "no-retries" else 1, how=fault)


def landed(proxy, state: str, part: str) -> list[s3_fault_proxy.Passed]:
    """The PUTs under ``state`` whose path contains ``part`` that the server applied."""
    where = "/" + filesystem(state)[1] + "/"
    return [p for p in proxy.puts(where) if part in p.key and p.status == 200]


def runs_json(state: str) -> dict:
    return json.loads(get_bytes(join(state, "runs", "current.json")))


def run_folders(state: str) -> list[str]:
    fs, path = filesystem(join(state, "runs"))
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in fs.ls(path, detail=False) if fs.isdir(p))


def ptr(i: int) -> dict[str, list[str]]:
    return {"tune/ckpt": [f"tune/payloads/ckpt-g1-s{i}-0"]}


# CI: each transition under one fault (rotated), in both modes; -m slow: every fault
CASES = [
    pytest.param(t, f, marks=() if f == FAULTS[i % len(FAULTS)] else pytest.mark.slow)
    for i, t in enumerate(TRANSITIONS)
    for f in FAULTS
]


@pytest.mark.parametrize(("transition", "fault"), CASES)
def test_lost_answer_resolved_once(state, proxy, mode, fault, transition, caplog):
    """The faulted control write landed once, the transition took effect exactly once (seq
    +1, ``last.op`` ours, pointers and generation as they should be), and there is one run."""
    key = "/current.json" if transition == "create-current" else "/control.json"
    caplog.set_level(logging.INFO, logger="spill.store.cas.objects")
    before, gen, ops, since = None, 1, 0, 0
    if transition.startswith("create"):
        arm(proxy, key, fault, mode)
        run = acquire(location(state), lease=60)
    else:
        run = acquire(location(state), lease=60)
        run.publish(ptr(1))
        ops = 1
        if transition == "acquire-released":
            run.release()
            gen, ops = 2, 0
        before = keys.current(location(state))
        since = len(landed(proxy, state, key))
        arm(proxy, key, fault, mode)
        if transition == "acquire-released":
            run = acquire(location(state), lease=60)
        elif transition == "renew":
            run.renew()
        elif transition == "publish":
            run.publish(ptr(2))
        elif transition == "complete":
            run.complete()
        elif transition == "release":
            run.release()
        ops += transition != "acquire-released"
    proxy.clear()

    doc = keys.current(location(state))
    assert doc["last"]["op"] == f"{run.nonce}:{ops}"
    assert doc["owner"]["nonce"] == run.nonce and doc["generation"] == gen == run.gen
    assert doc["seq"] == (1 if before is None else before["seq"] + 1)
    assert doc["pointers"] == ({} if before is None else ptr(2 if transition == "publish" else 1))
    assert doc["status"] == ("complete" if transition == "complete" else "active")
    assert doc["owner"]["released"] is (transition in ("complete", "release"))
    assert run.doc == doc
    # one run, named by runs/current.json, and no other run's folder
    listing = runs_json(state)
    assert listing["runs"] == [doc["run"]] and listing["current"] == doc["run"]
    assert run_folders(state) == [doc["run"]]

    # the server's side: the faulted write landed, and it is the only one of the transition
    writes = landed(proxy, state, key)[since:]
    assert len(writes) == 1 and writes[0].fault == fault
    body = json.loads(writes[0].body)
    if transition == "create-current":
        assert body["current"] == doc["run"]
    else:
        assert body["seq"] == doc["seq"] and body["last"]["op"] == doc["last"]["op"]
    retried = [p for p in proxy.puts(key) if p.status == 412 and state.split("/")[2] in p.path]
    uncertain = [r for r in caplog.records if r.getMessage().startswith("uncertain write of")]
    if mode == "retries":
        assert retried, "the client retried the landed write and the server refused it"
    else:
        assert uncertain, "the client saw no answer, so cas reported the write uncertain"


@pytest.mark.parametrize(("n", "seed"), [(12, 10), pytest.param(60, 11, marks=pytest.mark.slow)])
def test_publishes_with_random_lost_answers(state, proxy, mode, n, seed):
    """N publications, about half of them with their answer lost (seeded), land exactly N
    pointer changes on the server, in order, each once."""
    rng = random.Random(seed)
    run = acquire(location(state), lease=60)
    start = keys.current(location(state))["seq"]
    since = len(landed(proxy, state, "/control.json"))
    faults = []
    for i in range(1, n + 1):
        fault = rng.choice((*FAULTS, "", "", ""))
        faults.append(fault)
        if fault:
            arm(proxy, "/control.json", fault, mode)
        run.publish(ptr(i))
        proxy.clear()
    assert sum(map(bool, faults)) >= n // 4
    doc = keys.current(location(state))
    assert doc["seq"] == start + n and doc["pointers"] == ptr(n)
    bodies = [json.loads(p.body) for p in landed(proxy, state, "/control.json")[since:]]
    assert [b["pointers"] for b in bodies] == [ptr(i) for i in range(1, n + 1)]
    assert [b["seq"] for b in bodies] == list(range(start + 1, start + n + 1))
    assert [b["last"]["op"] for b in bodies] == [f"{run.nonce}:{i}" for i in range(1, n + 1)]
    assert runs_json(state)["runs"] == [doc["run"]]


# --- a real ``spill tune`` on S3 through the proxy ----------------------------------------------

STEP4 = b'ckpt-g1-s4-0",'  # only the step-4 publication lists step 4 first (then step 2)


@pytest.fixture(scope="module")
def control(tmp_path_factory, tiny_models) -> kit.Control:
    return kit.control(tmp_path_factory, tiny_models)


@pytest.mark.parametrize(
    "retries",
    [
        # botocore and s3fs retry by themselves: every attempt after the landed one gets a 412
        pytest.param("default", marks=pytest.mark.slow),
        # no botocore retries, and every s3fs (and aiohttp) attempt loses its answer: cas sees
        # an uncertain write and _transact finds its own operation in the control object
        "none",
    ],
)
def test_tune_with_a_lost_checkpoint_publication_equals_the_control(
    control, s3_bucket, proxy, retries, tmp_path
):
    """``spill tune --state s3://...`` whose step-4 checkpoint publication lands but is never
    answered finishes like the uninterrupted control, byte for byte, with the same transitions:
    no publication lost or doubled."""
    state = f"s3://{s3_bucket}/job"
    extra = {"AWS_ENDPOINT_URL": proxy.url, "AWS_MAX_ATTEMPTS": "1" if retries == "none" else ""}
    env = {k: v for k, v in kit.spill_env(tmp_path / "home", **extra).items() if v}
    proxy.clear()
    proxy.drop_next_put(f"/{s3_bucket}/job/runs/", n=1 if retries == "default" else 12, body=STEP4)
    done = kit.run_tune(kit.tune_argv(control.model, control.train, state), env)
    proxy.clear()
    assert done.returncode == 0, done.stderr[-3000:]

    kit.assert_same_checkpoint(state, control.state)
    assert kit.adapter_files(state) == kit.adapter_files(control.state)
    doc, want = keys.current(location(state)), keys.current(control.state)
    assert doc["status"] == want["status"] == "complete"
    assert doc["seq"] == want["seq"] and doc["pointers"] == want["pointers"]
    assert runs_json(state)["runs"] == [doc["run"]] and run_folders(state) == [doc["run"]]

    where = f"/{s3_bucket}/job/runs/{doc['run']}/control.json"
    sent = proxy.puts(where)
    applied = [json.loads(p.body) for p in sent if p.status == 200]
    assert [b["seq"] for b in applied] == list(range(1, doc["seq"] + 1))  # each transition once
    assert [STEP4 in p.body for p in sent if p.status == 200].count(True) == 1
    lost = [p for p in sent if p.fault]
    assert lost[0].status == 200, "the lost answer was to a write that landed"
    assert all(p.status == 412 for p in lost[1:])  # every retry of it was refused
    if retries == "default":
        assert len(lost) == 1 and any(p.status == 412 for p in sent)
    else:  # the child gave up on the write: nothing but re-reads resolved it
        assert len(lost) > 1 and all(STEP4 in p.body for p in sent if p.status == 412)
