"""The model cache under ``SPILL_HOME/models``: source markers (``read_marker``, ``write_marker``),
cached fingerprints (``cached_fingerprint``), the listing (``list_models``).

Every folder a source writes (tiny, GGUF import, hub snapshot, staged copy) carries a
``spill-source.json`` marker saying where it came from (the layout: the comment at ``MARKER``). The
marker validates against ``schemas/model-source.schema.json`` on every read; an invalid one is
refused in one line (its recorded hashes are never trusted), and listing shows it as an error. The
per-file sha256 records and their checks live in ``spill.models.integrity``.
"""

from __future__ import annotations

import fnmatch
import json
import os
from pathlib import Path

from spill.errors import ModelError
from spill.ground.paths import models_dir

# Layout:
#   models/<safe alias>/                          imported once as floats (smollm2:135m@f32)
#   models/<safe alias>-<type>/                   imported with its quantization (smollm2:135m,
#                                                 smollm2:135m@q4_1)
#   models/quantized/<safe name>-q<b>g<g>/        `spill models quantize` (tiny:llama:1:4x64@q4g64)
#   models/hub/models--<org>--<name>/snapshots/<sha>/   the hub client's own cache layout
#   models/staged/<safe name>-<uri hash>/         copied from --weights <uri>
MARKER = "spill-source.json"
# The files a model folder needs; hub downloads and staging copy only these.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer*.json",
    "special_tokens_map.json",
    "chat_template*",
)
_SKIP_DIRS = {"blobs", "refs", ".locks", ".cache", "trees"}


def is_model_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in MODEL_FILES)


_VALID: set[bytes] = set()  # marker bytes that passed the schema in this process


class MarkerInvalid(ModelError):
    """A ``spill-source.json`` that is unreadable or does not match its schema."""


def read_marker(folder: Path) -> dict:
    """The folder's marker, or ``{}`` when it has none (a user's own folder); raises
    ``MarkerInvalid`` for one that cannot be read or does not match its schema."""
    from spill.ground.validate import SchemaInvalid, parse_json, short, validate

    path = Path(folder) / MARKER
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except OSError as e:
        raise MarkerInvalid(f"{path}: cannot be read ({e.strerror}); fix its permissions") from None
    fix = f"delete it to use the folder without recorded hashes, or delete {path.parent} and fetch the model again"
    try:
        doc = parse_json(raw)
        if raw not in _VALID:  # a job reads its marker several times; no per-machine memo files
            validate(doc, "model-source", where=str(path))
            _VALID.add(raw)
    except ValueError as e:
        raise MarkerInvalid(f"{path}: not valid JSON ({short(e, 80)}); {fix}") from None
    except SchemaInvalid as e:
        detail = str(e).split(" schema at ", 1)[-1].split("; it was written", 1)[0]
        raise MarkerInvalid(f"{path}: not a spill model record (at {detail}); {fix}") from None
    return doc


def write_marker(folder: Path, **fields) -> dict:
    """Merge ``fields`` into the folder's marker (written to a temp name, then renamed); an
    invalid marker is refused, never silently replaced (it may hold the only recorded hashes)."""
    folder = Path(folder)
    old = read_marker(folder)
    doc = {**old, **fields}
    if doc == old and (folder / MARKER).is_file():
        return doc
    tmp = folder / f".{MARKER}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, folder / MARKER)
    return doc


def _fingerprint_key(folder: Path, hashes: dict[str, str]) -> list[list]:
    """Name and stat key (size, mtime_ns, ctime_ns, inode) of every file the fingerprint reads,
    then the recorded sha256 it used: any write moves a ctime, which userland cannot set back."""
    key = []
    for path in sorted(folder.iterdir()):
        if path.name == "config.json" or path.name.endswith(
            (".safetensors", ".safetensors.index.json")
        ):
            st = path.stat()  # follows the hub cache's symlinks to the blobs
            key.append([path.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    return key + [["recorded", *(f"{n} {h}" for n, h in sorted(hashes.items()))]]


# The marker also caches the weight fingerprint, keyed by the stat keys of the files the fingerprint
# reads and the sha256 recorded for them, so listing a cache of 70B models does not re-read every
# safetensors header, and a folder without records is hashed in full once, not at every job start.
def cached_fingerprint(folder: Path) -> str:
    """``weights.fingerprint(folder)`` over the shards' recorded sha256 (checked at every job
    start, so free here); a folder without records is hashed once, then reused from the marker
    while its files' stat keys are unchanged."""
    from spill.models.weights import fingerprint

    folder = Path(folder)
    marker = read_marker(folder)
    hashes = {
        n: r["sha256"] for n, r in (marker.get("files") or {}).items() if n.endswith(".safetensors")
    }
    key = _fingerprint_key(folder, hashes)
    cached = marker.get("fingerprint")
    if isinstance(cached, dict) and cached.get("key") == key and cached.get("value"):
        return cached["value"]
    value = fingerprint(folder, hashes)
    try:
        write_marker(folder, fingerprint={"key": key, "value": value})
    except OSError:
        pass  # a read-only folder (shared storage) is listed, just not cached
    return value


def imported(name: str) -> Path | None:
    """The folder ``spill models import`` wrote for ``name`` (``<stem>@<type>``, ``<stem>`` or
    its ``--name``): ``models/<safe name>`` when its marker records exactly that name."""
    from spill.models.names import safe_name

    folder = models_dir() / safe_name(name)
    if not (folder / "config.json").is_file() or read_marker(folder).get("name") != name.strip():
        return None
    return folder


def _model_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir() if is_model_file(p.name) and p.is_file())


def model_folders(root: Path | None = None) -> list[Path]:
    """Every folder under ``root`` (default ``SPILL_HOME/models``) that holds a config.json."""
    root = Path(root) if root is not None else models_dir()
    found = []
    for here, dirs, files in os.walk(root):
        if "config.json" in files:
            found.append(Path(here))
            dirs[:] = []  # a model folder is a leaf
            continue
        # hidden names are partial imports and temp folders; the rest is the hub's bookkeeping
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _SKIP_DIRS)
    return sorted(found)


def _default_name(folder: Path, root: Path) -> tuple[str, str]:
    """Name and source of a folder without a marker; hub snapshots read as ``org/name@sha``."""
    parts = folder.relative_to(root).parts
    if (
        len(parts) == 4
        and parts[0] == "hub"
        and parts[1].startswith("models--")
        and parts[2] == "snapshots"
    ):
        return parts[1][len("models--") :].replace("--", "/", 1) + "@" + parts[3][:12], "hub"
    return "/".join(parts), "unknown"


def _entry(folder: Path, root: Path) -> dict:
    name, source = _default_name(folder, root)
    entry = {
        "name": name,
        "folder": str(folder),
        "bytes": _model_bytes(folder),  # model files only: the marker's own size never counts
        "source": source,
        "fingerprint": None,
        "hashes": 0,
        "error": None,
    }
    try:  # an invalid marker lists as an error: safe here, since nothing is trusted from it
        marker = read_marker(folder)
        entry.update(name=marker.get("name") or name, source=marker.get("source", source))
        entry["hashes"] = len(marker.get("files") or {})
        entry["fingerprint"] = cached_fingerprint(folder)
    except (ModelError, OSError, ValueError) as e:  # a broken folder is listed, with why
        entry["error"] = str(e)
    return entry


def list_models() -> list[dict]:
    """One dict per model folder under ``SPILL_HOME/models``: name, folder, bytes, source,
    fingerprint, hashes (how many files have a recorded sha256), and error (None, or why the
    folder cannot be used)."""
    root = models_dir()
    return [_entry(folder, root) for folder in model_folders(root)]
