"""A job's view of its run: its folder under the state location, its pointers, its payloads.

Payloads are folders written once, ``<job>/payloads/<kind>-g<generation>-s<seq>-<attempt>/``,
so two writers never write one name; a payload is current only while a pointer of the control
object names it. A ``Place`` with a run (``Run.place``) allocates payloads and publishes; one
without (``Place(state, prefix)``) reads the current control object only.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from spill.control.cas import current
from spill.store.fs import join, listdir, remove

if TYPE_CHECKING:
    from spill.control.control import Run

PAYLOADS = "payloads"
_PAYLOAD = re.compile(r"([a-z]+)-g(\d+)-s(\d+)-(\d+)")


class Place:
    """A job's part of a run: ``<state>/<prefix>`` and the pointers named ``<prefix>/<name>``.

    With a ``run`` it can allocate payloads and publish; without one it only reads the current
    control object (status, probes)."""

    def __init__(self, state: str, prefix: str = "", run: Run | None = None):
        self.state, self.prefix, self.run = state, prefix.strip("/"), run
        self._doc: dict[str, Any] | None = None

    @property
    def uri(self) -> str:
        return join(self.state, self.prefix) if self.prefix else self.state

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
        taken = [n for n in listdir(join(self.uri, PAYLOADS)) if n.startswith(stem)]
        return join(self.uri, PAYLOADS, f"{stem}{len(taken)}")

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
        (URIs) of generations up to ours. A later generation's payloads are never touched."""
        assert self.run is not None
        base = join(self.uri, PAYLOADS)
        for n in listdir(base):
            m = _PAYLOAD.fullmatch(n)
            uri = join(base, n)
            if m and m[1] == kind and int(m[2]) <= self.run.gen and uri not in keep:
                remove(uri)


def payload_seq(uri: str) -> int | None:
    """The ``s<seq>`` of a payload folder's name (a tune step, a segment number)."""
    m = _PAYLOAD.fullmatch(uri.rstrip("/").rsplit("/", 1)[-1])
    return int(m[3]) if m else None
