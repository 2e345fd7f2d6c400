"""A job's view of its run: its folder under the state location, its pointers, its payloads.

Payloads are folders written once, ``<job>/payloads/<kind>-g<generation>-s<seq>-<attempt>/``,
current only while a pointer of the control object names it. A ``Place`` with a run
(``Ownership.place``) allocates payloads and publishes; one without (``Place(state, prefix)``)
only reads. ``collect`` and ``clear`` never remove a payload any control object at the location
points at. The pointers of runs that never change again (complete, transferred, copy) are read
once per process, so a save on an object store reads only the control objects that may change.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Protocol

from spill.control.keys import CONTROL, FROZEN, current, read_control, run_ids
from spill.errors import StoreError
from spill.store.cas import Store
from spill.store.fs import join, listdir, remove
from spill.store.location import Location

PAYLOADS = "payloads"
STAGES = "stages"  # a build's job places, stages/<stage>/, each with payloads of its own
_PAYLOAD = re.compile(r"([a-z]+)-g(\d+)-s(\d+)-(\d+)")

log = logging.getLogger(__name__)
_frozen: dict[str, frozenset[str]] = {}  # a frozen run's control object URI -> its pointers


class Run(Protocol):
    """What a place needs of the run that owns it (``spill.control.control.Ownership``, which
    makes its places)."""

    id: str
    gen: int
    doc: dict[str, Any]
    store: Store

    def publish(self, pointers: dict[str, list[str] | None], what: str = ...) -> None: ...


class Place:
    """A job's part of a run: ``<state>/<prefix>`` and the pointers named ``<prefix>/<name>``.

    With a ``run`` it can allocate payloads and publish; without one it only reads the current
    control object (status, probes)."""

    # the caller parses (a build's followers get their Location pickled whole); text would pass,
    # a Location being a str, and be joined as text
    def __init__(self, state: Location, prefix: str = "", run: Run | None = None):
        assert isinstance(state, Location), f"{state!r}: a Location, parsed once by the caller"
        self.state, self.prefix, self.run = state, prefix.strip("/"), run
        self._doc: dict[str, Any] | None = None

    @property
    def uri(self) -> Location:
        return self.state.join(self.prefix) if self.prefix else self.state

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _rel(self, rel: str) -> str:
        return rel[len(self.prefix) + 1 :] if self.prefix else rel

    def doc(self) -> dict[str, Any] | None:
        if self.run is not None:
            return self.run.doc
        if self._doc is None:
            self._doc = current(self.state) or {}
        return self._doc or None

    def pointer(self, name: str) -> list[str]:
        """URIs of the payloads named ``name``, newest first (``[]`` when none)."""
        doc = self.doc()
        rels = (doc or {}).get("pointers", {}).get(self.key(name), [])
        return [join(self.state, r) for r in rels]

    def payload(self, kind: str, seq: int) -> str:
        """A new payload folder's URI: ``payloads/<kind>-g<gen>-s<seq>-<attempt>``."""
        assert self.run is not None, "a read-only place allocates no payloads"
        stem = f"{kind}-g{self.run.gen}-s{seq}-"
        names = listdir(join(self.uri, PAYLOADS))
        taken = [int(n[len(stem) :]) for n in names if _PAYLOAD.fullmatch(n) and n.startswith(stem)]
        return join(self.uri, PAYLOADS, f"{stem}{max(taken, default=-1) + 1}")

    def publish(self, name: str, uris: list[str]) -> None:
        assert self.run is not None
        rels = [u[len(self.state) :].strip("/") for u in uris]
        self.run.publish({self.key(name): rels or None})

    def drop(self) -> None:
        """Drop every pointer under this place (its job state is cleared)."""
        assert self.run is not None
        doc = self.run.doc
        mine = [k for k in doc["pointers"] if not self.prefix or k.startswith(self.prefix + "/")]
        if mine:
            self.run.publish(dict.fromkeys(mine), "drop")

    def collect(self, kind: str, keep: set[str]) -> None:
        """Remove payloads of ``kind`` that no pointer of this run needs: those not in ``keep``
        (URIs) of generations up to ours, except what another control object points at. A
        later generation's payloads are never touched; when the other control objects cannot
        be read, nothing is removed (the next collection tries again)."""
        assert self.run is not None
        try:
            others = pointed_elsewhere(self.run.store, self.run.id)
        except (StoreError, OSError) as e:
            log.warning("payloads of %s not collected yet: %s", self.uri, e)
            return
        keep = keep | {join(self.state, rel) for rel in others}
        base = join(self.uri, PAYLOADS)
        for n in listdir(base):
            m = _PAYLOAD.fullmatch(n)
            uri = join(base, n)
            if m and m[1] == kind and int(m[2]) <= self.run.gen and uri not in keep:
                remove(uri)

    def clear(self) -> None:
        """Remove everything under this place (its job starts afresh) except the payload folders
        another control object points at; this run's own pointers here are dropped first."""
        assert self.run is not None
        self.drop()
        spare = pointed_elsewhere(self.run.store, self.run.id)
        _remove_except(self.uri, self.prefix, spare)


def _remove_except(uri: Location, rel: str, spare: set[str]) -> None:
    """Remove ``uri`` (``rel`` under the state) but the paths in ``spare`` below it."""
    if rel in spare:
        return
    below = f"{rel}/" if rel else ""
    if not any(s.startswith(below) for s in spare):
        remove(uri)
        return
    for n in listdir(uri):
        _remove_except(join(uri, n), below + n, spare)


def pointed_elsewhere(store: Store, run: str) -> set[str]:
    """The payloads (relative to the location) that the control objects of runs other than
    ``run`` at ``store`` point at."""
    out: set[str] = set()
    for rid in run_ids(store):
        if rid == run:
            continue
        key = store.uri(f"{rid}/{CONTROL}")
        if (known := _frozen.get(key)) is None:
            doc, _ = read_control(store, rid)
            if doc is None:
                continue
            known = frozenset(rel for rels in doc["pointers"].values() for rel in rels)
            if doc["status"] in FROZEN:
                _frozen[key] = known
        out |= known
    return out


def generations(state: Location) -> list[int]:
    """The generations in the names of the payload folders at ``state``: its ``payloads/`` and
    each build stage's (``stages/<stage>/payloads/``), where a run writes its payloads."""
    homes = [PAYLOADS, *(f"{STAGES}/{n}/{PAYLOADS}" for n in listdir(join(state, STAGES)))]
    names = [n for home in homes for n in listdir(join(state, home))]
    return [int(m[2]) for n in names if (m := _PAYLOAD.fullmatch(n))]


def payload_seq(uri: str) -> int | None:
    """The ``s<seq>`` of a payload folder's name (a tune step, a segment number)."""
    m = _PAYLOAD.fullmatch(uri.rstrip("/").rsplit("/", 1)[-1])
    return int(m[3]) if m else None
