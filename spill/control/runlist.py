"""A state location's runs as a whole: every control object under ``runs/``, and the
generation a new run takes.

``next_generation``: a new run's generation is one above every generation a control object
here has had and every generation in a payload folder's name, so no payload name is reused
even where control objects were deleted and their payloads stayed.
"""

from __future__ import annotations

from typing import Any

from spill.control.cas import CONTROL, Store, read_control, run_ids
from spill.control.place import generations
from spill.errors import StoreError


def controls(store: Store) -> dict[str, dict[str, Any]]:
    """Every control object under ``runs/`` by run id (a run folder without one is skipped)."""
    out = {}
    for rid in run_ids(store):
        doc, _ = read_control(store, rid)
        if doc is None:
            continue
        if doc["run"] != rid:
            raise StoreError(
                f"{store.uri(f'{rid}/{CONTROL}')} is the control object of run {doc['run']}, "
                f"copied there by hand; move {store.uri(rid)} away"
            )
        out[rid] = doc
    return out


def next_generation(store: Store) -> int:
    """A new run's generation: above every control object's and every payload folder's here."""
    docs = controls(store)
    gens = [d["generation"] for d in docs.values()] + generations(store.state)
    return max(gens, default=0) + 1
