"""Row-job results as committed segments: ``<root>/rows/seg-<n>.jsonl`` + ``seg-<n>.commit``.

A row job (run, distill, eval) hands each finished row to a ``SegmentWriter``, which pushes the
buffered rows every 25 rows or 60 seconds (checked whenever a row is added, or on ``tick()``)
and on ``flush()``/``close()``. A push writes the JSONL first and the commit marker (schema
``segment-commit``: row ids, count, size, sha256, producer) second; a segment counts only when
both are there and agree. ``restore`` returns the rows of the committed segments in order, so a
job that continues runs only the rows left: a row is never lost (it is either committed or
redone) nor repeated (a committed id is refused, and restore keeps the first of any duplicate).

``rows/identity.json`` (schema ``row-identity``) pins the model (id + fingerprint) and the input
(sha256); continuing with any other value is refused in one line naming the difference.

Uncommitted or damaged segments and temporary files are ignored with a logged line and removed by
the writer's first push. Crash point for kill drills: ``seg-before-commit``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from spill.errors import StoreError
from spill.store import drill
from spill.store.fs import get_bytes, is_temp, join, listdir, put_bytes, remove
from spill.store.schemas import SchemaInvalid, parse_json, validate

ROWS = "rows"
IDENTITY = "identity.json"
PUSH_ROWS = 25
PUSH_SECONDS = 60.0
SCHEMA_VERSION = 1
PRODUCER_KEYS = ("engine", "hardware", "os", "numerics")
_SEG = re.compile(r"seg-(\d+)\.(jsonl|commit)")

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


def pin_identity(root_uri: str, identity: Mapping[str, Any]) -> dict[str, Any]:
    """Write ``rows/identity.json`` or check it: another model or input fails in one line."""
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
    a, b = _flat(pinned), _flat(doc)
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
    return pinned


def _read_segment(rows_uri: str, n: int) -> tuple[dict, list[Any]]:
    base = join(rows_uri, f"seg-{n}")
    try:
        commit = parse_json(get_bytes(base + ".commit"))
        validate(commit, "segment-commit", where=base + ".commit")
    except (ValueError, SchemaInvalid) as e:
        raise SegmentInvalid(base, f"unreadable commit ({e})") from None
    try:
        data = get_bytes(base + ".jsonl")
    except FileNotFoundError:
        raise SegmentInvalid(base, "the .jsonl is missing") from None
    if commit["segment"] != n:
        raise SegmentInvalid(base, f"the commit is for segment {commit['segment']}")
    if len(data) != commit["size"]:
        raise SegmentInvalid(base, f"{len(data)} bytes, the commit says {commit['size']}")
    if hashlib.sha256(data).hexdigest() != commit["sha256"]:
        raise SegmentInvalid(base, "sha256 differs from the commit")
    lines = data.split(b"\n")  # bytes: str.splitlines would also split at U+2028 inside a row
    if (
        lines[-1] != b""
        or len(lines) - 1 != commit["count"]
        or commit["count"] != len(commit["row_ids"])
    ):
        raise SegmentInvalid(base, "line count differs from the commit")
    return commit, [parse_json(line) for line in lines[:-1]]


def _scan(
    root_uri: str, level: int = logging.WARNING
) -> tuple[list[tuple[dict, list[Any]]], list[str], int]:
    """Committed segments in order, URIs of litter (with the reason logged), next free number."""
    rows_uri = join(root_uri, ROWS)
    names = listdir(rows_uri)
    parts: dict[int, set[str]] = {}
    litter = [join(rows_uri, n) for n in names if is_temp(n)]
    for name in names:
        if m := _SEG.fullmatch(name):
            parts.setdefault(int(m[1]), set()).add(m[2])
    good = []
    for n in sorted(parts):
        base = join(rows_uri, f"seg-{n}")
        if "commit" not in parts[n]:
            log.log(
                level,
                "ignoring segment %s: no commit (its push was interrupted); the next push removes it",
                base,
            )
            litter.append(base + ".jsonl")
            continue
        try:
            good.append(_read_segment(rows_uri, n))
        except (SegmentInvalid, UnicodeDecodeError, ValueError) as e:
            log.log(level, "ignoring %s; the next push removes it", e)
            # the commit goes first, so a crash midway leaves the segment merely uncommitted
            litter += [base + ".commit", base + ".jsonl"]
    return good, litter, max(parts, default=-1) + 1


def restore(root_uri: str) -> Restored:
    """Every committed row under ``root_uri`` in push order, and their ids."""
    good, _, _ = _scan(root_uri)
    rows, done, seen = [], [], set()
    for commit, seg_rows in good:
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


def commit_markers(root_uri: str) -> list[dict[str, Any]]:
    """The commit markers under ``root_uri/rows`` in segment order, read without hashing the
    rows: a light progress probe (what a job trusts is ``restore``)."""
    rows_uri = join(root_uri, ROWS)
    found = sorted(
        int(m[1]) for n in listdir(rows_uri) if (m := _SEG.fullmatch(n)) and m[2] == "commit"
    )
    out = []
    for n in found:
        try:
            doc = parse_json(get_bytes(join(rows_uri, f"seg-{n}.commit")))
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
        root_uri: str,
        identity: Mapping[str, Any],
        producer: Mapping[str, Any],
        *,
        every_rows: int = PUSH_ROWS,
        every_seconds: float = PUSH_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if missing := [k for k in PRODUCER_KEYS if not producer.get(k)]:
            raise ValueError(f"producer lacks {', '.join(missing)}")
        self.root_uri = root_uri
        self.producer = dict(producer)
        self.every_rows, self.every_seconds, self._clock = every_rows, every_seconds, clock
        pin_identity(root_uri, identity)
        # quieter than restore(), which the job calls first and which already said it
        good, self._litter, self._next = _scan(root_uri, logging.INFO)
        self._done: set[RowId] = {rid for commit, _ in good for rid in commit["row_ids"]}
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
        for uri in self._litter:
            remove(uri)
        self._litter = []
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
        base = join(self.root_uri, ROWS, f"seg-{n}")
        validate(commit, "segment-commit", where=base + ".commit")
        put_bytes(base + ".jsonl", data)
        drill.at(drill.SEG_BEFORE_COMMIT)
        put_bytes(base + ".commit", _dump(commit))
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
