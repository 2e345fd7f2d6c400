"""One writer per run: control objects, leases and fencing. The protocol: docs/authority.md.

A state location holds ``runs/current.json`` (which run is current, schema ``runs``),
``runs/control.lock`` (local locations only: the flock every transition holds) and
``runs/<id>/control.json`` (the run's authority, schema ``control``), changed only by conditional
transitions (``spill.store.cas``). ``spill.control.ownership.acquire`` returns an ``Ownership``; a
writer whose generation is no longer the run's gets ``Superseded``, and what it wrote is never
pointed at.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from spill.control.keys import CONTROL, read_control
from spill.control.place import Place
from spill.errors import EXIT_PREEMPTED, SpillError, StoreError
from spill.store import drill
from spill.store.cas import ATTEMPTS, Conflict, Store, Uncertain
from spill.store.location import Location

SCHEMA_VERSION = 1
# A bench-only switch: transitions after acquisition change this process's copy of the control
# object and write nothing, so that bench/authority.py can price them. Never for real work.
UNFENCED_ENV = "SPILL_BENCH_UNFENCED"
WATCH = 2.0  # seconds between an owner's reads of its control object (a move may quiesce it)

log = logging.getLogger(__name__)


class Busy(SpillError):
    """The run has a live owner; try again later (exit 75, like a preempted job)."""

    exit_code = EXIT_PREEMPTED


class Superseded(SpillError):
    """This process's generation is no longer the run's: another owner took it over."""


class RunComplete(StoreError):
    """A completed run is read-only."""


def iso_time(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


# Made by ``spill.control.ownership.acquire``, which makes this process the owner at the next
# generation when the run is free, else raises ``Busy`` (exit 75) or waits. It renews its lease on a
# heartbeat, reads the control object every ``WATCH`` seconds so that a move's quiesce stops it
# soon, and publishes through fenced transitions.
class Ownership:
    """This process's ownership of a run: transitions, heartbeat, and its places."""

    def __init__(self, store: Store, doc: dict[str, Any], lease: float):
        self.store, self.doc, self.lease = store, doc, lease
        self.id, self.gen, self.nonce = doc["run"], doc["generation"], doc["owner"]["nonce"]
        self._lock = threading.RLock()
        self._ops = 0
        self._beat: threading.Thread | None = None
        self._stop = threading.Event()
        self.lost: Superseded | None = None
        self._tag: str | None = None  # the tag of this process's last write of the document
        # called once when a transition finds the run quiescing (a move asks it to stop)
        self.on_quiesce: Callable[[dict[str, Any]], None] | None = None

    @property
    def state(self) -> Location:
        return self.store.state

    def place(self, prefix: str = "") -> Place:
        return Place(self.state, prefix, self)

    # transitions

    def _transact(
        self, what: str, change: Callable[[dict[str, Any]], dict[str, Any] | None]
    ) -> dict:
        """Apply ``change`` to the newest document as a fenced, conditional transition."""
        with self._lock:
            if self.lost is not None:
                raise self.lost
            self._ops += 1
            op = f"{self.nonce}:{self._ops}"
            key = f"{self.id}/{CONTROL}"
            if os.environ.get(UNFENCED_ENV) == "1":  # bench/authority.py's baseline only
                self.doc = change(json.loads(json.dumps(self.doc))) or self.doc
                return self.doc
            # our last write's document and tag, unread: a replace conditional on that tag
            # fails (412, or the local check) if anyone wrote since, and only then is it read
            known = (self.doc, self._tag) if self._tag else None
            for _ in range(ATTEMPTS):
                with self.store.exclusive():
                    doc, tag = known or read_control(self.store, self.id)
                    known = None
                    if doc is None:
                        raise StoreError(
                            f"{self.store.uri(key)} disappeared; the state was damaged"
                        )
                    if doc["last"]["op"] == op:  # an uncertain write of ours that did land
                        self.doc = doc
                        return doc
                    self._fence(doc)
                    self._quiescing(doc)
                    new = change(json.loads(json.dumps(doc)))
                    if new is None:
                        self.doc = doc
                        return doc
                    now = time.time()
                    new["seq"] = doc["seq"] + 1
                    new["last"] = {"op": op, "what": what, "at": now}
                    new["updated"] = iso_time(now)
                    if not new["owner"]["released"] and new["status"] != "complete":
                        new["lease"]["expires"] = now + self.lease
                    try:
                        self._tag = self.store.put(key, new, "control", tag)
                    except (Conflict, Uncertain):
                        self._tag = None
                        continue
                self.doc = new
                return new
            raise StoreError(
                f"{self.store.uri(key)}: {what} lost {ATTEMPTS} conditional writes in a row; "
                "try again"
            )

    def _fence(self, doc: dict[str, Any]) -> None:
        o = doc["owner"]
        if doc["generation"] != self.gen or o["nonce"] != self.nonce:
            self.lost = Superseded(
                f"run {self.id} was taken over by {o['host']} pid {o['pid']} (generation "
                f"{doc['generation']}); this process (generation {self.gen}) stops, and what it "
                "wrote since is not used"
            )
            raise self.lost
        if doc["status"] == "complete":  # complete() also releases: say why nothing may change
            raise RunComplete(f"run {self.id} is complete and read-only")
        if o["released"]:
            raise StoreError(f"run {self.id} was released by this process; acquire it again")

    def renew(self) -> None:
        self._transact("renew", lambda d: d)
        drill.at(drill.CONTROL_RENEW)

    def publish(self, updates: dict[str, list[str] | None], what: str = "publish") -> None:
        """Set (or, with None, drop) pointers, fenced by this owner's generation."""

        def change(d: dict[str, Any]) -> dict[str, Any] | None:
            if d["status"] == "complete":
                raise RunComplete(f"run {self.id} is complete and read-only")
            ptrs = d["pointers"]
            before = dict(ptrs)
            for name, value in updates.items():
                if value:
                    ptrs[name] = value
                else:
                    ptrs.pop(name, None)
            return d if ptrs != before else None

        self._transact(what, change)
        drill.at(drill.CONTROL_PUBLISH)

    def complete(self) -> None:
        """The one fenced transition after which the run is read-only."""

        def change(d: dict[str, Any]) -> dict[str, Any] | None:
            if d["status"] == "complete":
                return None
            d["status"] = "complete"
            d["lease"]["expires"] = time.time()
            d["owner"]["released"] = True
            return d

        self.stop_heartbeat()
        self._transact("complete", change)
        drill.at(drill.CONTROL_COMPLETE)

    def release(self) -> None:
        """Give the run up (a stop, an error): a successor may acquire at once."""
        self.stop_heartbeat()
        if self.lost is not None or self.doc["owner"]["released"]:
            return

        def change(d: dict[str, Any]) -> dict[str, Any] | None:
            d["owner"]["released"] = True
            d["lease"]["expires"] = time.time()
            return d

        try:
            self._transact("release", change)
        except (Superseded, StoreError) as e:
            log.info("releasing run %s: %s", self.id, e)

    # heartbeat

    def start_heartbeat(self, on_lost: Callable[[Superseded], None] | None = None) -> None:
        if self._beat is not None:
            return
        self._stop.clear()

        def beat() -> None:
            due = time.monotonic() + self.lease / 3
            while not self._stop.wait(max(0.0, min(WATCH, due - time.monotonic()))):
                if time.monotonic() < due:
                    self._watch()
                    continue
                due = time.monotonic() + self.lease / 3
                try:
                    self.renew()
                except Superseded as e:
                    if on_lost is None:
                        log.warning("%s", e)
                    else:
                        on_lost(e)
                    return
                except (StoreError, OSError) as e:  # a passing network problem: next beat
                    log.warning("renewing the lease of run %s: %s", self.id, e)

        self._beat = threading.Thread(target=beat, name=f"spill-lease-{self.id}", daemon=True)
        self._beat.start()

    def _watch(self) -> None:
        """Between renewals, read the control object (no write) so that a move's quiesce stops
        this owner within ``WATCH`` seconds, not at its next renewal (a third of the lease)."""
        if self.on_quiesce is None:
            return
        try:
            doc, _ = read_control(self.store, self.id)
        except (StoreError, OSError) as e:
            log.info("watching run %s: %s", self.id, e)
            return
        if doc is not None and doc["owner"]["nonce"] == self.nonce:
            self._quiescing(doc)

    def _quiescing(self, doc: dict[str, Any]) -> None:
        """Call ``on_quiesce`` once, whichever of the watch and a transition sees it first."""
        if doc["status"] != "quiescing":
            return
        with self._lock:
            asked, self.on_quiesce = self.on_quiesce, None
        if asked is not None:
            asked(doc)

    def stop_heartbeat(self) -> None:
        self._stop.set()
        beat, self._beat = self._beat, None
        if beat is not None and beat is not threading.current_thread():
            beat.join(timeout=5)
