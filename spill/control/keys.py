"""A state location's control keys: ``runs/current.json`` (the run list), one
``runs/<id>/control.json`` per run and the lock ``runs/control.lock``, written through the
conditional writes of ``spill.store.cas`` (``store_for``), and read back validated.

``current`` is the readers' view of the current run (``spill.control.runlist``: when
``runs/current.json`` is missing, the view rebuilt from the control objects).
"""

from __future__ import annotations

import re
from typing import Any

from spill.errors import StoreError
from spill.ground.validate import parse_json, validate_once
from spill.store import cas
from spill.store.cas import Layout, Store
from spill.store.fs import join, listdir

RUNS = "runs"
CURRENT = "current.json"
CONTROL = "control.json"
LOCK = "control.lock"
RUN_ID = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")  # as schemas/runs.schema.json says
LAYOUT = Layout(
    folder=RUNS,
    lock=LOCK,
    folder_is="the folder of the runs",
    subfolder_is="a run's folder",
    object_is="a control object",
    named={CURRENT: "the run list"},
    then={  # what removing a fixed name that holds something else leads to
        LOCK: "; the next command makes it again",
        CURRENT: "; the next command rebuilds it from the runs' control objects",
        CONTROL: ", then put the run's control object back from a copy (else the run is lost)",
    },
)


def store_for(state: str) -> Store:
    """The store of ``state``'s control keys, checked (a local one honours flock, an object
    store refuses stale writes)."""
    return cas.store_for(state, LAYOUT)


def open_store(state: str) -> Store:
    """The store of ``state``'s control keys, unchecked: enough to read them."""
    return cas.open_store(state, LAYOUT)


def parse(raw: bytes, schema: str, where: str) -> dict[str, Any]:
    try:
        doc = parse_json(raw)
    except ValueError as e:
        raise StoreError(f"{where} is not JSON ({e}); it was damaged") from None
    validate_once(raw, doc, schema, where)
    return doc


def run_list(runs: list[str]) -> dict[str, Any]:
    """A ``runs/current.json`` document: the last of ``runs`` is current."""
    return {"schema_version": 1, "kind": "spill-runs", "current": runs[-1], "runs": runs}


def read_runs(store: Store) -> tuple[dict[str, Any] | None, str | None]:
    raw, tag = store.read(CURRENT)
    return (None, None) if raw is None else (parse(raw, "runs", store.uri(CURRENT)), tag)


def read_control(store: Store, run: str) -> tuple[dict[str, Any] | None, str | None]:
    key = f"{run}/{CONTROL}"
    raw, tag = store.read(key)
    return (None, None) if raw is None else (parse(raw, "control", store.uri(key)), tag)


def run_ids(store: Store) -> list[str]:
    """The ids of the runs under ``runs/`` (folders named like a run), sorted."""
    return [n for n in listdir(join(store.state, RUNS)) if RUN_ID.fullmatch(n)]


def current(state: str) -> dict[str, Any] | None:
    """The current run's control object at ``state`` (validated), or None; a reader's view: no
    lock taken, nothing written (``spill.control.runlist.current``)."""
    from spill.control.runlist import current as view

    return view(state)
