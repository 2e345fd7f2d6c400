"""Uncertain outcomes on GCS (fake-gcs-server) and Azure Blob (Azurite): a control write lands
but its answer is lost, and the writer resolves it by reading again, with no lost and no
doubled transition.

The same HTTP proxy as on S3 (``s3_fault_proxy``) sits between the cloud's client and its
emulator: it forwards a control write (GCS: the upload POST that names the key in its body;
Azure: the blob PUT), lets the server apply it, then closes the connection or answers 503.
Each client retries by itself (google-cloud-storage retries an upload that has a generation
precondition; azure-core retries connection errors and 5xx): the retried conditional write is
refused (412, or 409 for a second create), and the transition reads again and finds its own
operation (``last.op``). The server's side is counted by the proxy: one write of the key landed
per transition, the faulted one.

The give-up path (``-m slow``): a store that answers every write of the control object with
503 and never applies it; each client retries for about 15 s, the transition reads again and
writes again, and after ``ATTEMPTS`` (2 here) it gives up in one line: nothing written, the run
still this owner's (a second acquirer is told it is busy), and once the store takes writes the
same transition lands once.
"""

from __future__ import annotations

import time
import uuid

import pytest

from spill.control import control, keys
from spill.control.control import Busy
from spill.control.ownership import acquire
from spill.errors import EXIT_USER, StoreError
from spill.store.location import location
from tests.func import s3_fault_proxy
from tests.servers import azure_env, gcs_env

FAULTS = ("close", "503")
TRANSITIONS = ("create-control", "create-current", "publish", "complete")
OK = {"gs": 200, "az": 201}  # what each server answers a write that landed


@pytest.fixture(scope="module", params=["gs", "az"])
def cloud(request):
    """``(scheme, proxy, env)``: a proxy in front of the session's emulator for ``scheme``."""
    endpoint = request.getfixturevalue(
        {"gs": "gcs_endpoint", "az": "azure_endpoint"}[request.param]
    )
    proxy = s3_fault_proxy.start(endpoint)
    if request.param == "gs":
        env = gcs_env(proxy.url)
    else:
        env = azure_env(proxy.url + "/" + endpoint.rsplit("/", 1)[1])
    yield request.param, proxy, env
    proxy.stop()


@pytest.fixture
def state(cloud, monkeypatch):
    scheme, proxy, env = cloud
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from spill.store.cas import cloud as clients

    monkeypatch.setattr(clients, "_clients", {})  # a client for this proxy
    import adlfs
    import gcsfs

    gcsfs.GCSFileSystem.clear_instance_cache()
    adlfs.AzureBlobFileSystem.clear_instance_cache()
    name = f"spill-{uuid.uuid4().hex[:10]}"
    if scheme == "gs":
        from google.cloud import storage

        storage.Client().create_bucket(name)
    else:
        from azure.storage.blob import BlobServiceClient

        conn = env["AZURE_STORAGE_CONNECTION_STRING"]
        BlobServiceClient.from_connection_string(conn).create_container(name)
    proxy.clear()
    yield f"{scheme}://{name}/state"
    proxy.clear()


def arm(cloud, state: str, key: str, fault: str) -> None:
    """Fault the next write of ``key`` (``/control.json``, ``/current.json``) under ``state``."""
    scheme, proxy, _ = cloud
    bucket = state.split("/")[2]
    if scheme == "gs":  # POST /upload/storage/v1/b/<bucket>/o, the object's name in the body
        part, body = f"/b/{bucket}/o", f'{key}"'.encode()
    else:  # PUT /<account>/<container>/<blob>
        part, body = key, b""
    if fault == "refuse":  # every write from now on, none of them forwarded
        proxy.refuse_next_put(part, n=10**6, body=body)
    elif fault == "503":
        proxy.fail_next_put(part, body=body)
    else:
        proxy.drop_next_put(part, how=fault, body=body)


def landed(cloud, state: str, key: str) -> list[s3_fault_proxy.Passed]:
    scheme, proxy, _ = cloud
    bucket = state.split("/")[2]
    if scheme == "gs":
        writes = proxy.writes(f"/b/{bucket}/o", f'{key}"'.encode())
    else:
        writes = [p for p in proxy.writes(f"/{bucket}/state/") if p.key.endswith(key)]
    return [p for p in writes if p.status == OK[scheme]]


def ptr(i: int) -> dict[str, list[str]]:
    return {"tune/ckpt": [f"tune/payloads/ckpt-g1-s{i}-0"]}


# CI: a create and a replace, each under one fault, on each store; -m slow: the rest
FAST = {("create-control", "close"), ("publish", "503")}
CASES = [
    pytest.param(t, f, marks=() if (t, f) in FAST else pytest.mark.slow)
    for t in TRANSITIONS
    for f in FAULTS
]


@pytest.mark.parametrize(("transition", "fault"), CASES)
def test_lost_answer_resolved_once(cloud, state, transition, fault):
    """The faulted control write landed once and the transition took effect exactly once."""
    key = "/current.json" if transition == "create-current" else "/control.json"
    before, ops, since = None, 0, 0
    if transition.startswith("create"):
        arm(cloud, state, key, fault)
        run = acquire(location(state), lease=60)
    else:
        run = acquire(location(state), lease=60)
        run.publish(ptr(1))
        ops = 1
        before = keys.current(location(state))
        since = len(landed(cloud, state, key))
        arm(cloud, state, key, fault)
        run.publish(ptr(2)) if transition == "publish" else run.complete()
        ops += 1
    assert cloud[1].pending() == 0, "the fault was applied"
    cloud[1].clear()

    doc = keys.current(location(state))
    assert doc["last"]["op"] == f"{run.nonce}:{ops}"
    assert doc["seq"] == (1 if before is None else before["seq"] + 1)
    assert doc["pointers"] == ({} if before is None else ptr(2 if transition == "publish" else 1))
    assert doc["status"] == ("complete" if transition == "complete" else "active")
    assert run.doc == doc
    writes = landed(cloud, state, key)[since:]
    assert len(writes) == 1 and writes[0].fault == fault, [(w.path, w.fault) for w in writes]
    refused = [p for p in cloud[1].writes() if p.status in (409, 412)]
    assert refused, "the client retried the landed write and the server refused it"


@pytest.mark.slow
def test_a_store_that_never_takes_the_write_is_given_up_on_in_one_line(cloud, state, monkeypatch):
    run = acquire(location(state), lease=60)
    run.publish(ptr(1))
    before = keys.current(location(state))
    monkeypatch.setattr(control, "ATTEMPTS", 2)
    since = len(cloud[1].writes())
    arm(cloud, state, "/control.json", "refuse")
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        run.publish(ptr(2))
    took = time.monotonic() - t0
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{state}/runs/{run.id}/control.json: "), line
    assert line.endswith(": publish lost 2 conditional writes in a row; try again"), line
    assert e.value.exit_code == EXIT_USER
    refused = cloud[1].writes()[since:]
    assert len(refused) >= 4 and all(p.status == 0 and p.fault == "503" for p in refused)
    assert took < 2 * 40, took  # each attempt about 15 s of the client's retries, not minutes
    print(f"{cloud[0]}: gave up after {len(refused)} refused writes in {took:.1f} s")

    assert keys.current(location(state)) == before  # nothing lost, nothing half-written
    with pytest.raises(Busy, match=f"run {run.id} at {state} is held by "):
        acquire(location(state), lease=60)  # still this owner's
    cloud[1].clear()
    run.publish(ptr(2))
    after = keys.current(location(state))
    assert after["pointers"] == ptr(2) and after["seq"] == before["seq"] + 1
    assert after["owner"] == before["owner"] and after["generation"] == before["generation"]
