"""What every conditional store is: ``Store`` reads the objects under one folder of a location
(``Layout``) with their tags and writes one only if it is new or unchanged since read, else
``Conflict`` (it changed) or ``Uncertain`` (the outcome is unknown); the caller reads again
either way and gives up after ``ATTEMPTS``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from spill.errors import EXIT_PREEMPTED, SpillError, StoreError
from spill.ground.validate import remember, validate
from spill.store.fs import join
from spill.store.location import Location, location

ATTEMPTS = 50  # conditional writes lost to others (or uncertain) before a transition gives up


@dataclass(frozen=True)
class Layout:
    """The folder a store keeps under its location, and what its refusals call the things in it."""

    folder: str  # under the location
    lock: str  # the local lock file, in the folder
    folder_is: str  # the folder itself, in words
    subfolder_is: str  # a folder in it
    object_is: str  # an object in it, unless ``named`` has a word for its key
    named: Mapping[str, str] = field(default_factory=dict)
    then: Mapping[str, str] = field(default_factory=dict)  # by name: what removing it leads to


class LockHeld(SpillError):
    """The local lock stays held (its holder was stopped mid-transition): try again later."""

    exit_code = EXIT_PREEMPTED


class Unsupported(StoreError):
    """A location whose transitions cannot be made safe (file system or object store)."""


class Conflict(Exception):
    """A conditional write lost: the object changed since it was read (412)."""


class Uncertain(Exception):
    """A conditional write whose outcome is unknown (timeout, dropped connection, 5xx)."""


class Store:
    """Read and conditionally write the objects under ``layout.folder`` of the location ``state``."""

    # whether ``exclusive`` keeps whole transitions apart (a lock): then no reader ever sees
    # what another transition made between two of its writes (an object store: False)
    serialized = False

    def put(self, key: str, doc: dict[str, Any], schema: str, tag: str | None) -> str:
        """Validate ``doc`` against ``schema`` and ``write`` it; returns the new object's tag.
        Its bytes are remembered as valid, so that the next read (``spill status``, a finished
        build) costs one hash."""
        raw = json.dumps(doc, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"
        validate(doc, schema, where=self.uri(key))
        new = self.write(key, raw, tag)
        remember(raw, schema)
        return new or self.tag_of(raw)

    def tag_of(self, data: bytes) -> str:
        """The tag ``read`` reports for an object holding ``data``."""
        return hashlib.sha256(data).hexdigest()

    def __init__(self, state: Location | str, layout: Layout):
        self.state: Location = location(state)  # text (a test's) parsed; a Location as it is
        self.layout = layout

    def uri(self, key: str) -> str:
        return join(self.state, self.layout.folder, key)

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        yield

    def read(self, key: str) -> tuple[bytes | None, str | None]:
        raise NotImplementedError

    def write(self, key: str, data: bytes, tag: str | None) -> str | None:
        """Create (``tag`` None) or replace the object last read with ``tag``; the new object's
        tag where the store reports it (GCS, Azure), else None (``tag_of`` tells it)."""
        raise NotImplementedError
