"""The probe of an object store's conditional writes: a store that ignores preconditions is
refused in one line and keeps nothing of the probe; the S3 server (moto, over HTTP) passes."""

from __future__ import annotations

import uuid

import pytest

from spill.store.cas import Layout, Unsupported, objects, store_for
from spill.store.fs import join, listdir

LAYOUT = Layout("runs", "lock", "the folder", "a folder in it", "an object")


def test_the_probe_refuses_a_store_that_ignores_preconditions():
    # memory:// refuses a second create but ignores If-Match and reports no ETag
    store = objects.ObjectStore(f"memory://spill-probe-{uuid.uuid4().hex[:8]}/state", LAYOUT)
    with pytest.raises(Unsupported) as e:
        objects.probe(store)
    assert "cannot make conditional writes" in str(e.value) and "\n" not in str(e.value)
    assert listdir(join(store.state, "runs")) == []  # its scratch key is gone


def test_the_probe_accepts_the_s3_server(s3_bucket):
    store = store_for(f"s3://{s3_bucket}/state", LAYOUT)
    assert isinstance(store, objects.ObjectStore)
