"""A state location's runs: its control keys (``runs/current.json`` the run list, one
``runs/<id>/control.json`` per run, the lock ``runs/control.lock``), written through
``spill.store.cas`` (``store_for``) and read back validated, and the run list as a whole.

Each run's control object is the authority; the list only says which run is current. ``view`` and
``current`` (readers) write nothing; ``restore`` (a writer, under the location's lock) rebuilds a
missing list, raising ``UnclearRuns`` where the current run cannot be told safely. The rules
``decide`` follows: docs/authority.md, "A lost run list, and what is never removed".
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from spill.errors import StoreError
from spill.ground.validate import parse_json, validate_once
from spill.store import cas, drill
from spill.store.cas import ATTEMPTS, Conflict, Layout, Store, Uncertain
from spill.store.fs import exists, join, listdir
from spill.store.location import Location

RUNS = "runs"
CURRENT = "current.json"
CONTROL = "control.json"
LOCK = "control.lock"
FROZEN = ("complete", "transferred", "copy")  # statuses a control object never leaves
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


def store_for(state: Location) -> Store:
    """The store of ``state``'s control keys, checked (a local one honours flock, an object
    store refuses stale writes)."""
    return cas.store_for(state, LAYOUT)


def open_store(state: Location) -> Store:
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


log = logging.getLogger(__name__)
# seconds after its create that an unused run may still be waiting for its run list: on an object
# store a first run's creator writes its control object, then the list (two racing first builds
# each make one, and a rebuild in between would see two unfinished runs)
START_WAIT = 5.0


class UnclearRuns(StoreError):
    """``runs/current.json`` is missing and the control objects do not say which run is current."""


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


def _ordered(docs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Parents before the runs made from them; otherwise oldest first (``created``, then id)."""
    left, out = dict(docs), []
    while left:
        ready = [d for d in left.values() if d["lineage"]["parent"] not in left]
        first = min(ready or left.values(), key=lambda d: (d["created"], d["run"]))
        out.append(left.pop(first["run"]))
    return out


def _said(doc: dict[str, Any]) -> str:
    return f"{doc['run']} ({doc['status']}, generation {doc['generation']}, {doc['created']})"


def decide(store: Store, docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The run list that ``docs`` (every control object at ``store``) imply (docs/authority.md)."""
    order = _ordered(docs)
    where, runs = store.uri(CURRENT), join(store.state, RUNS)
    live = [d for d in order if d["status"] not in FROZEN]
    used = [d for d in live if d["last"]["what"] != "create"]
    done = [d for d in order if d["status"] in FROZEN]
    if len(used) > 1 or not (used or done) and len(live) > 1:
        them = ", ".join(_said(d) for d in (used if len(used) > 1 else live))
        raise UnclearRuns(
            f"{where} is missing and more than one run there is unfinished: {them}; keep the "
            f"one to continue and move the others' folders out of {runs}, then run the command "
            "again"
        )
    if used or not done:
        now = (used or live)[0]
    else:  # every run finished (or never used): the newest that no finished run came from
        parents = {d["lineage"]["parent"] for d in done}
        leaves = [d for d in done if d["run"] not in parents] or done  # (a hand-made cycle)
        newest = max(d["created"] for d in leaves)
        tied = [d for d in leaves if d["created"] == newest]
        if len(tied) > 1:
            them = ", ".join(_said(d) for d in tied)
            raise UnclearRuns(
                f"{where} is missing and its newest runs were made in the same second: {them}; "
                f"keep the current one and move the others' folders out of {runs}, then run the "
                "command again"
            )
        now = tied[0]
    return run_list([*(d["run"] for d in order if d is not now), now["run"]])


# Readers (``spill status``, probes, a build's plan) see a missing list rebuilt in memory and write
# nothing.
def view(store: Store) -> tuple[dict[str, Any] | None, str | None, bool]:
    """The run list (and its tag), rebuilt in memory when missing; whether it was rebuilt."""
    runs, tag = read_runs(store)
    if runs is not None:
        return runs, tag, False
    docs = controls(store)
    return (decide(store, docs), None, True) if docs else (None, None, False)


def starting(store: Store, docs: dict[str, dict[str, Any]], now: float) -> bool:
    """Whether the runs of a location without a run list may be first runs whose creators are
    about to list them: on an object store, every unfinished one unused and made just now."""
    live = [d for d in docs.values() if d["status"] not in FROZEN]
    # abs: another host's clock may run ahead; either way the wait ends as ours goes on
    young = all(
        d["last"]["what"] == "create" and abs(now - d["last"]["at"]) < START_WAIT for d in live
    )
    return not store.serialized and bool(live) and young


# The list is created conditionally, so of two rebuilders one wins. On an object store a first run's
# control object may be made a moment before its list: ``restore`` waits for that list
# (``START_WAIT``).
def restore(store: Store) -> tuple[dict[str, Any] | None, str | None]:
    """The run list of ``store`` and its tag; a missing one is rebuilt from the control objects
    and created (None when there are none), unless it may be a first run's list still to come
    (``starting``): that is read again until it lands. Called under ``store.exclusive()``."""
    pause, tries = 0.02, 0
    while tries < ATTEMPTS:
        runs, tag = read_runs(store)
        if runs is not None:
            return runs, tag
        docs = controls(store)
        if not docs:
            return None, None
        if starting(store, docs, time.time()):  # bounded: START_WAIT after the newest create
            time.sleep(pause)
            pause = min(pause * 2, 0.25)
            continue
        tries += 1
        runs = decide(store, docs)
        try:
            tag = store.put(CURRENT, runs, "runs", None)
        except (Conflict, Uncertain):  # another rebuilder won (or ours landed): read it
            continue
        log.warning("%s was missing; rebuilt from %s", store.uri(CURRENT), _line(runs, docs))
        drill.at(drill.CONTROL_REBUILD)
        return runs, tag
    raise StoreError(f"{store.uri(CURRENT)}: could not be rebuilt; try again")


def _line(runs: dict[str, Any], docs: dict[str, dict[str, Any]]) -> str:
    n = len(runs["runs"])
    many = f"s of {n} runs" if n > 1 else " of 1 run"
    return f"the control object{many}: current is run {_said(docs[runs['current']])}"


def missing_note(state: Location) -> str | None:
    """For ``spill status``: a line saying the run list is missing and what stands in for it."""
    store = open_store(state)
    runs, _, rebuilt = view(store)
    if not rebuilt or runs is None:
        return None
    line = _line(runs, controls(store))
    return f"{store.uri(CURRENT)} is missing; read from {line}; the next build or resume writes it"


def has_runs(state: Location) -> bool:
    """Whether ``state`` holds runs: a run list, or control objects without one."""
    if exists(join(state, RUNS, CURRENT)):
        return True
    return any(exists(join(state, RUNS, rid, CONTROL)) for rid in run_ids(open_store(state)))


def current(state: Location) -> dict[str, Any] | None:
    """The current run's control object at ``state`` (validated), or None when it has none.

    A reader's view: no lock is taken (every write is an atomic replace) and nothing is
    written; a missing run list is rebuilt in memory (``view``)."""
    store = open_store(state)  # reading needs no flock, so no file system check
    runs, _, _ = view(store)
    if runs is None:
        return None
    doc, _ = read_control(store, runs["current"])
    if doc is None:
        raise StoreError(
            f"{store.uri(CURRENT)} names run {runs['current']}, which has no control object; "
            "the state was copied incompletely"
        )
    return doc
