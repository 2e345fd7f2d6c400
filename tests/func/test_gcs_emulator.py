"""What fake-gcs-server does when an object is replaced under a reader (issue 26's gs flake was
first suspected of it; the cause was spill's: ``spill.control.keys.START_WAIT``).

* A replace with ``ifGenerationMatch`` is atomic to readers: while one thread replaces a small
  object as fast as it can, two others reading it by name never get a 404 or a torn body. Real
  GCS promises the same (strongly consistent reads after a write).
* A ``Blob`` that has been downloaded remembers the generation it got, and its next download asks
  for that generation: 404 once the object was replaced. ``spill.store.cas.cloud.GcsObjects.read``
  makes a fresh ``Blob`` per read for this reason.
"""

from __future__ import annotations

import threading
import time

import pytest

SECONDS = 3.0
KEY = "runs/current.json"


@pytest.mark.slow
def test_a_replace_is_atomic_to_a_reader(gcs_bucket):
    from google.api_core import exceptions
    from google.cloud import storage

    client = storage.Client()
    first = client.bucket(gcs_bucket).blob(KEY)
    first.upload_from_string(b"0" * 300, if_generation_match=0)
    stop, seen, counts = threading.Event(), [], {"writes": 0, "reads": 0}

    def writer() -> None:
        blob, gen, i = client.bucket(gcs_bucket).blob(KEY), first.generation, 0
        while not stop.is_set():
            i += 1
            blob.upload_from_string(str(i % 10).encode() * 300, if_generation_match=gen)
            gen = blob.generation
            counts["writes"] += 1

    def reader() -> None:
        while not stop.is_set():
            try:
                data = client.bucket(gcs_bucket).blob(KEY).download_as_bytes()  # a fresh Blob
                if len(data) != 300 or len(set(data)) != 1:
                    seen.append(("torn", data[:12]))
            except exceptions.NotFound:
                seen.append(("missing",))
            counts["reads"] += 1

    threads = [threading.Thread(target=f) for f in (writer, reader, reader)]
    for t in threads:
        t.start()
    time.sleep(SECONDS)
    stop.set()
    for t in threads:
        t.join()
    assert counts["writes"] > 50 and counts["reads"] > 100, counts
    assert seen == [], (counts, seen[:3])

    reused = client.bucket(gcs_bucket).blob(KEY)
    reused.download_as_bytes()  # it now names the generation it read ...
    client.bucket(gcs_bucket).blob(KEY).upload_from_string(b"x", if_generation_match=None)
    with pytest.raises(exceptions.NotFound):  # ... which the replace removed
        reused.download_as_bytes()
    assert client.bucket(gcs_bucket).blob(KEY).download_as_bytes() == b"x"
