"""The store of a location, by how its control keys are written (``Location.writes``): a local
disk's flock, ``memory://``'s process lock, or an object store's preconditions."""

from __future__ import annotations

from spill.store.cas.local import LocalStore, MemoryStore
from spill.store.cas.objects import ObjectStore, probe
from spill.store.cas.store import Layout, Store
from spill.store.location import Location, location


def open_store(state: Location | str, layout: Layout) -> Store:
    """The store of ``layout`` at ``state``, unchecked: enough to read (reads take no lock); the
    kind is the location's (``Location.writes``)."""
    state = location(state)
    if state.writes == "flock":
        return LocalStore(state, layout)
    if state.writes == "process":
        return MemoryStore(state, layout)
    return ObjectStore(state, layout)


def store_for(state: Location | str, layout: Layout) -> Store:
    """The store of ``layout`` at ``state``, checked (a local one honours flock, an object store
    refuses stale writes)."""
    s = open_store(state, layout)
    if isinstance(s, LocalStore):
        s.check()
    elif not isinstance(s, MemoryStore):
        probe(s)
    return s
