"""Conditional writes of the objects under one folder of a location: a write creates an object
or replaces the one last read, or raises ``Conflict`` (it changed since) or ``Uncertain`` (its
outcome is unknown); the caller reads again either way.

``store_for`` gives a location's store, checked: a local disk's ``flock`` (``local``), one lock
per process for ``memory://`` (``local``), an object store's If-None-Match/If-Match, probed once
per bucket and process (``objects``; GCS and Azure through their own clients, ``cloud``).
``open_store`` gives it unchecked, enough to read. Nothing is ever deleted.
"""

from spill.store.cas.local import FLOCK_FS, LocalStore, MemoryStore
from spill.store.cas.objects import ObjectStore
from spill.store.cas.pick import open_store, store_for
from spill.store.cas.store import (
    ATTEMPTS,
    Conflict,
    Layout,
    LockHeld,
    Store,
    Uncertain,
    Unsupported,
)

__all__ = [
    "ATTEMPTS",
    "FLOCK_FS",
    "Conflict",
    "Layout",
    "LocalStore",
    "LockHeld",
    "MemoryStore",
    "ObjectStore",
    "Store",
    "Uncertain",
    "Unsupported",
    "open_store",
    "store_for",
]
