"""Row-job results as committed segments: payload folders
``<job>/payloads/rows-g<gen>-s<n>-<attempt>/`` with ``rows.jsonl`` and, written second, ``COMMIT``
(schema ``segment-commit``). A ``SegmentWriter`` pushes every 25 rows or 60 seconds and on
``flush()``/``close()``, adding each segment to the run's ``rows`` pointer by a fenced transition.
``restore`` returns the rows of the pointed, verified segments in order, so a continued job runs
only the rows left: none lost, none repeated. ``pin_identity`` pins the model and input in
``rows/identity.json`` (schema ``row-identity``). What a push writes, and what it removes:
docs/design.md, "Payloads".
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from spill.control.place import Place, payload_seq
from spill.errors import StoreError
from spill.ground.validate import SchemaInvalid, parse_json, validate
from spill.payloads.newest import COMMIT
from spill.store import drill
from spill.store.fs import get_bytes, join, put_bytes

ROWS = "rows"
IDENTITY = "identity.json"
PUSH_ROWS = 25
PUSH_SECONDS = 60.0
SCHEMA_VERSION = 1
PRODUCER_KEYS = ("engine", "hardware", "os", "numerics")
KIND = "rows"
DATA = "rows.jsonl"

RowId = str | int

log = logging.getLogger(__name__)


class IdentityMismatch(StoreError):
    """A state location that belongs to a row job with another model or input."""


class SegmentInvalid(StoreError):
    def __init__(self, uri: str, reason: str):
        super().__init__(f"segment {uri}: {reason}")


class Restored(NamedTuple):
    rows: list[Any]  # committed result rows, in push order
    done: list[RowId]  # done[i] is the id of rows[i]


def _dump(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"


def _flat(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in doc.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _short(v: Any) -> str:
    text = "(none)" if v is _MISSING else repr(v)
    return text if len(text) <= 48 else text[:45] + "..."


_MISSING = object()


def pin_identity(
    root_uri: str,
    identity: Mapping[str, Any],
    same_weights: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    """Write ``rows/identity.json`` or check it: another model or input fails in one line.
    ``same_weights(fingerprint)``: whether a pinned weight fingerprint other than this job's
    still names its weights (one recorded by an older definition); the identity is then pinned
    again with this job's."""
    doc = {"schema_version": SCHEMA_VERSION, **identity}
    uri = join(root_uri, ROWS, IDENTITY)
    validate(doc, "row-identity", where=uri)
    try:
        raw = get_bytes(uri)
    except FileNotFoundError:
        put_bytes(uri, _dump(doc))
        return doc
    try:
        pinned = parse_json(raw)
    except ValueError:
        raise StoreError(
            f"{uri} is not JSON; it was damaged, so use a new --state location"
        ) from None
    validate(pinned, "row-identity", where=uri)
    bases = [d["model"].get("quantization") for d in (pinned, doc)]
    other = pinned["model"]["fingerprint"] != doc["model"]["fingerprint"]
    again = other and same_weights is not None and same_weights(pinned["model"]["fingerprint"])
    if again:
        pinned = {
            **pinned,
            "model": {**pinned["model"], "fingerprint": doc["model"]["fingerprint"]},
        }
        other = False
    if bases[0] != bases[1] and other:  # another quantization: say which, not a changed file
        there, here = (f"{q['format']} weights" if q else "float weights" for q in bases)
        raise IdentityMismatch(
            f"{root_uri} holds rows computed on {there}, this job is on {here}; ask for the same "
            "quantization (--quantize, --group-size), or use a new --state location"
        )
    # the same weights: an identity pinned before quantized bases were named stays valid
    a, b = (
        {k: v for k, v in _flat(d).items() if not k.startswith("model.quantization.")}
        for d in (pinned, doc)
    )
    files = "model.files."  # per-file hashes: named only for the same model, recorded on both sides
    same = pinned["model"]["id"] == doc["model"]["id"]
    if not (same and pinned["model"].get("files") and doc["model"].get("files")):
        a, b = ({k: v for k, v in d.items() if not k.startswith(files)} for d in (a, b))
    for key in sorted(a.keys() | b.keys()):
        if key.startswith(files) and a.get(key) != b.get(key):
            x, y = (str(d.get(key, "(none)"))[:12] for d in (a, b))
            raise IdentityMismatch(
                f"{root_uri}: the model's file {key[len(files) :]} changed since this run started "
                f"(sha256 {x}.. -> {y}..); restore it, or use a new --state location"
            )
        if a.get(key, _MISSING) != b.get(key, _MISSING):
            raise IdentityMismatch(
                f"{root_uri} holds rows of another job: {key} is {_short(a.get(key, _MISSING))} "
                f"there and {_short(b.get(key, _MISSING))} here; use a new --state location"
            )
    if again:
        put_bytes(uri, _dump(doc))
        return doc
    return pinned


def _read_segment(uri: str, n: int) -> tuple[dict, list[Any]]:
    try:
        commit = parse_json(get_bytes(join(uri, COMMIT)))
        validate(commit, "segment-commit", where=join(uri, COMMIT))
    except FileNotFoundError:
        raise SegmentInvalid(uri, "no commit (its push was interrupted)") from None
    except (ValueError, SchemaInvalid) as e:
        raise SegmentInvalid(uri, f"unreadable commit ({e})") from None
    try:
        data = get_bytes(join(uri, DATA))
    except FileNotFoundError:
        raise SegmentInvalid(uri, f"the {DATA} is missing") from None
    if commit["segment"] != n:
        raise SegmentInvalid(uri, f"the commit is for segment {commit['segment']}")
    if len(data) != commit["size"]:
        raise SegmentInvalid(uri, f"{len(data)} bytes, the commit says {commit['size']}")
    if hashlib.sha256(data).hexdigest() != commit["sha256"]:
        raise SegmentInvalid(uri, "sha256 differs from the commit")
    lines = data.split(b"\n")  # bytes: str.splitlines would also split at U+2028 inside a row
    if (
        lines[-1] != b""
        or len(lines) - 1 != commit["count"]
        or commit["count"] != len(commit["row_ids"])
    ):
        raise SegmentInvalid(uri, "line count differs from the commit")
    return commit, [parse_json(line) for line in lines[:-1]]


def _scan(place: Place, level: int = logging.WARNING) -> tuple[list[tuple[str, dict, list]], int]:
    """The pointed segments that verify, oldest first (URI, commit, rows), and the next free
    segment number."""
    pointed = place.pointer(KIND)
    good = []
    for uri in reversed(pointed):
        try:
            commit, rows = _read_segment(uri, payload_seq(uri))
        except (SegmentInvalid, UnicodeDecodeError, ValueError) as e:
            log.log(level, "ignoring %s; the next push drops it", e)
            continue
        good.append((uri, commit, rows))
    return good, max((payload_seq(u) for u in pointed), default=-1) + 1


def restore(place: Place) -> Restored:
    """Every committed row of ``place`` in push order, and their ids."""
    good, _ = _scan(place)
    rows, done, seen = [], [], set()
    for _, commit, seg_rows in good:
        for rid, row in zip(commit["row_ids"], seg_rows, strict=True):
            if rid in seen:
                log.warning(
                    "row %r is committed twice (segment %d); keeping the first",
                    rid,
                    commit["segment"],
                )
                continue
            seen.add(rid)
            rows.append(row)
            done.append(rid)
    return Restored(rows, done)


def commit_markers(place: Place) -> list[dict[str, Any]]:
    """The commit markers of the pointed segments in order, read without hashing the rows: a
    light progress probe (what a job trusts is ``restore``)."""
    out = []
    for uri in reversed(place.pointer(KIND)):
        try:
            doc = parse_json(get_bytes(join(uri, COMMIT)))
        except (FileNotFoundError, ValueError):
            continue
        if isinstance(doc, dict) and type(doc.get("count", 0)) is int and doc.get("count", 0) >= 0:
            out.append(doc)  # a marker that cannot even say its count is damaged: skipped
    return out


class SegmentWriter:
    """Buffers finished rows and pushes them as committed segments.

    ``identity`` is pinned (or checked) on construction; ``producer`` holds at least engine,
    hardware, os and numerics and is recorded in every segment's commit.
    """

    def __init__(
        self,
        place: Place,
        identity: Mapping[str, Any],
        producer: Mapping[str, Any],
        *,
        every_rows: int = PUSH_ROWS,
        every_seconds: float = PUSH_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if missing := [k for k in PRODUCER_KEYS if not producer.get(k)]:
            raise ValueError(f"producer lacks {', '.join(missing)}")
        self.place = place
        self.producer = dict(producer)
        self.every_rows, self.every_seconds, self._clock = every_rows, every_seconds, clock
        pin_identity(place.uri, identity)
        # quieter than restore(), which the job calls first and which already said it
        good, self._next = _scan(place, logging.INFO)
        self._segments = [uri for uri, _, _ in reversed(good)]  # newest first, as pointed
        self._tidy = True  # the first push drops damaged segments and removes litter
        self._done: set[RowId] = {rid for _, commit, _ in good for rid in commit["row_ids"]}
        self._buf: list[tuple[RowId, str]] = []
        self._since: float | None = None

    @property
    def done(self) -> frozenset[RowId]:
        """Ids committed or buffered: every row that must not be run again."""
        return frozenset(self._done)

    @property
    def pending(self) -> int:
        return len(self._buf)

    def add(self, row_id: RowId, row: Any) -> bool:
        """Buffer one finished row; pushes when a boundary is due. Returns whether it pushed.

        ``row`` must be JSON-serialisable without NaN or infinities (give those as None).
        """
        if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
            raise TypeError(f"row id {row_id!r} must be a str or an int")
        if row_id in self._done:
            raise ValueError(f"row {row_id!r} is already done; a row is never written twice")
        line = json.dumps(row, ensure_ascii=False, allow_nan=False)
        self._buf.append((row_id, line))
        self._done.add(row_id)
        if self._since is None:
            self._since = self._clock()
        return self.tick()

    def tick(self) -> bool:
        """Push if 25 rows are buffered or the oldest buffered row waited 60 s."""
        if not self._buf:
            return False
        assert self._since is not None
        if len(self._buf) >= self.every_rows or self._clock() - self._since >= self.every_seconds:
            self.flush()
            return True
        return False

    def flush(self) -> int | None:
        """Push the buffered rows as the next segment; returns its number (None if empty)."""
        if not self._buf:
            return None
        data = "".join(line + "\n" for _, line in self._buf).encode()
        n = self._next
        commit = {
            "schema_version": SCHEMA_VERSION,
            "kind": "spill-segment",
            "segment": n,
            "count": len(self._buf),
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "row_ids": [rid for rid, _ in self._buf],
            "producer": self.producer,
        }
        target = self.place.payload(KIND, n)
        validate(commit, "segment-commit", where=join(target, COMMIT))
        put_bytes(join(target, DATA), data)
        drill.at(drill.SEG_BEFORE_COMMIT)
        put_bytes(join(target, COMMIT), _dump(commit))
        self._segments.insert(0, target)
        self.place.publish(KIND, self._segments)
        if self._tidy:
            self.place.collect(KIND, set(self._segments))
            self._tidy = False
        self._buf.clear()
        self._since = None
        self._next = n + 1
        return n

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        # rows in the buffer are finished results, worth keeping whatever stopped the job
        self.flush()
