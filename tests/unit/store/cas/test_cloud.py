"""Conditional writes on GCS (fake-gcs-server) and Azure Blob (Azurite), over HTTP on loopback,
through the store and its probe: a second create is refused, a wrong and a stale tag are
refused, the good replace lands and reports the tag the next read gets."""

from __future__ import annotations

import pytest

from spill.control.keys import run_list
from spill.errors import StoreError
from spill.store.cas import Conflict, Layout, Unsupported, cloud, objects, store_for
from spill.store.fs import listdir
from tests.conftest import bucket_uri

LAYOUT = Layout("runs", "lock", "the folder", "a folder in it", "an object")
CLOUDS = ["gs", "az"]


@pytest.fixture(params=CLOUDS)
def state(request) -> str:
    return f"{bucket_uri(request, request.param)}/state"


def test_the_probe_accepts_the_emulator(state):
    store = store_for(state, LAYOUT)
    assert isinstance(store, objects.ObjectStore) and store.cloud is not None
    assert [n for n in listdir(store.uri("")) if n.startswith(".probe")] == []


def test_create_once_then_replace_only_the_tag_read(state):
    store = store_for(state, LAYOUT)
    first = store.write("a/obj", b"one", None)
    assert store.read("a/obj") == (b"one", first)
    with pytest.raises(Conflict):  # a second create
        store.write("a/obj", b"two", None)
    with pytest.raises(Conflict):  # a wrong tag
        store.write("a/obj", b"two", objects._wrong(first))
    second = store.write("a/obj", b"three", first)
    assert second != first and store.read("a/obj") == (b"three", second)
    with pytest.raises(Conflict):  # a stale tag
        store.write("a/obj", b"four", first)
    with pytest.raises(Conflict):  # a replace of an object that is not there
        store.write("a/none", b"x", first)
    assert store.read("a/obj") == (b"three", second) and store.read("a/none") == (None, None)


def test_put_returns_the_tag_the_next_read_gets(state):
    store = store_for(state, LAYOUT)
    runs = ["20261202-143000-abcdef"]
    tag = store.put("current.json", run_list(runs), "runs", None)
    assert store.read("current.json")[1] == tag
    again = store.put("current.json", run_list([*runs, "20261202-143100-abcdef"]), "runs", tag)
    assert again != tag and store.read("current.json")[1] == again


@pytest.mark.parametrize("where", CLOUDS)
def test_a_missing_bucket_is_named(request, where):
    state = f"{bucket_uri(request, where)}-not-there/state"
    with pytest.raises(StoreError, match="does not exist") as e:
        store_for(state, LAYOUT)
    assert "\n" not in str(e.value)


class _AcceptsAll(cloud.Objects):
    """A server that takes every write and ignores preconditions (as gcp-storage-emulator)."""

    def __init__(self):
        self.objects: dict[str, tuple[bytes, str]] = {}

    def read(self, path):
        return self.objects.get(path, (None, None))

    def write(self, path, data, tag):
        new = str(len(self.objects) + 100)
        self.objects[path] = (data, new)
        return new


def test_the_probe_refuses_a_cloud_that_ignores_preconditions(gcs_bucket):
    store = objects.ObjectStore(f"gs://{gcs_bucket}/state", LAYOUT)
    store.cloud = _AcceptsAll()
    with pytest.raises(Unsupported, match="a second create of one key succeeded") as e:
        objects.probe(store)
    assert "\n" not in str(e.value)


def test_azure_without_an_account_is_one_line(monkeypatch):
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cloud, "_clients", {})
    with pytest.raises(StoreError, match="no Azure storage account given; set") as e:
        cloud.AzureObjects()
    assert "\n" not in str(e.value)
