"""JSON Schema validation of every document spill writes and reads (ground floor: it imports only
``spill.errors``, ``spill.ground.paths`` and the schema files): ``validate``, ``validate_once``.

Schemas are draft 2020-12 files in the repository's ``schemas/``, installed as the package
``spill.schemas`` and read from its folder (``spill.schemas.DIR``). A document that does not
validate is refused in one line that names the file kind, the failing field and why. Every file
spill reads is validated on read, not only on write.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from functools import cache
from typing import Any

from spill.errors import StoreError
from spill.ground.paths import spill_home
from spill.schemas import DIR  # a plain open: importlib.resources costs 3 ms to import

SUFFIX = ".schema.json"
KEEP_MARKERS = 512
MESSAGE_CHARS = 160  # a huge or multi-line value is cut, so a refusal stays one short line


class SchemaInvalid(StoreError):
    """A stored document that does not match its JSON Schema."""


@cache
def _schema_bytes(name: str) -> bytes:
    try:
        return (DIR / f"{name}{SUFFIX}").read_bytes()
    except FileNotFoundError:
        raise ValueError(f"no schema named {name!r} in spill.schemas ({DIR})") from None


@cache
def _validator(name: str):
    import jsonschema

    schema = json.loads(_schema_bytes(name))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def load_schema(name: str) -> dict:
    """The schema ``name`` (``"commit"`` or ``"commit.schema.json"``) as a dict."""
    return _validator(name.removesuffix(SUFFIX)).schema


def validate(doc: Any, name: str, where: str | None = None) -> None:
    """Raise ``SchemaInvalid`` unless ``doc`` matches schema ``name``; ``where`` names the file."""
    name = name.removesuffix(SUFFIX)
    from jsonschema.exceptions import best_match

    error = best_match(_validator(name).iter_errors(doc))
    if error is None:
        return
    field = "/".join(str(p) for p in error.absolute_path) or "(top level)"
    label = where or f"a {name} document"
    raise SchemaInvalid(
        f"{label} does not match the {name} schema at {short(field)}: {short(error.message)}; "
        "it was written by another version or damaged, so it is not used: use the spill that "
        "wrote it, or move the file away to start that part fresh"
    )


def short(text: str, limit: int = MESSAGE_CHARS) -> str:
    """``text`` on one line, cut to about ``limit`` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_json(raw: bytes | str) -> Any:
    """``json.loads`` whose every failure is a ``ValueError``: bytes that are not UTF-8 (also
    the surrogates that ``json.loads`` would let through from bytes), bad JSON, a ``\\ud800``
    escape that is no character (it could not even be printed), nesting too deep to parse."""
    text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray)) else raw
    try:
        doc = json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to be a spill file") from None
    if "\\u" in text:
        try:
            json.dumps(doc, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("a \\u escape names a lone surrogate, not a character") from None
    return doc


def _marker(raw: bytes, name: str) -> str:
    h = hashlib.sha256(hashlib.sha256(_schema_bytes(name)).digest())
    h.update(raw)
    return os.path.join(spill_home(), "validated", f"{name}-{h.hexdigest()}")


# Importing jsonschema costs about as much as the rest of a finished ``spill build`` (~70 ms here),
# so ``validate_once`` remembers, per machine, the sha256 of (schema, document bytes) that passed:
# the next read of the same bytes costs one hash and one ``stat``, and any change to the file (or to
# the schema) validates again. The record is a folder of empty marker files under
# ``SPILL_HOME/validated/``, pruned to the newest ``KEEP_MARKERS``; a marker that cannot be written
# only costs the next read its speed.
def validate_once(
    raw: bytes,
    doc: Any,
    name: str,
    where: str | None = None,
    also: Callable[[Any], None] | None = None,
) -> None:
    """``validate(doc, name, where)`` (and ``also(doc)``, a further check) unless the same bytes
    ``raw`` of ``doc`` passed both on this machine before, with the same schema."""
    name = name.removesuffix(SUFFIX)
    marker = _marker(raw, name)
    if os.path.exists(marker):
        return
    validate(doc, name, where)
    if also is not None:
        also(doc)
    _remember(marker)


def remember(raw: bytes, name: str) -> None:
    """Record bytes the caller validated as ``validate_once`` would (a writer, after writing)."""
    _remember(_marker(raw, name.removesuffix(SUFFIX)))


def _remember(marker: str) -> None:
    folder = os.path.dirname(marker)
    try:
        os.makedirs(folder, exist_ok=True)
        with open(marker, "wb"):
            pass
        names = os.listdir(folder)
        if len(names) > KEEP_MARKERS:
            paths = [os.path.join(folder, n) for n in names]
            paths.sort(key=lambda p: os.stat(p).st_mtime_ns if os.path.exists(p) else 0)
            for p in paths[: len(paths) - KEEP_MARKERS // 2]:
                if p != marker:
                    os.remove(p)
    except OSError:
        pass  # a read-only or racing SPILL_HOME: the next read validates again
