"""What a build is made from, as two hashes a state records: the compose key (everything
composing spill.yaml reads: spill.yaml, the project's group files, spill's shipped conf/, the
overrides, spill's version) and the data file's sha256. Equal keys, equal configs: a build
whose key and data hash match its record answers without composing (no Hydra, no jsonschema)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import spill.conf
from spill import __version__
from spill.errors import DataError
from spill.ground.hashing import file_sha256

FILE = "spill.yaml"


def data_sha256(path: Path | str) -> str:
    """The data file's hash as build states record it (``sha256:`` + hex)."""
    try:
        return "sha256:" + file_sha256(path)
    except FileNotFoundError:
        raise DataError(f"{path}: the project's data file is missing (data.file)") from None


def project_files(root: Path) -> list[Path]:
    """spill.yaml and the project's own group options (``<root>/<group>/*.yaml``)."""
    found = [root / FILE]
    for sub in sorted(root.iterdir()):
        if sub.is_dir() and not sub.name.startswith("."):
            found += sorted(sub.glob("*.yaml"))
    return found


def compose_key(root: Path | str, overrides: Sequence[str] = ()) -> str:
    """A hash of everything composing ``root/spill.yaml`` reads; equal keys, equal configs."""
    root = Path(root).resolve()
    h = hashlib.sha256(f"spill {__version__}\0".encode())
    h.update(json.dumps(list(overrides)).encode())
    shipped = Path(spill.conf.__file__).parent
    for base, files in ((root, project_files(root)), (shipped, sorted(shipped.rglob("*.yaml")))):
        for path in files:
            try:
                data = path.read_bytes()
            except OSError:
                data = b"(missing)"
            h.update(f"\0{base == root}:{path.relative_to(base).as_posix()}\0".encode())
            h.update(hashlib.sha256(data).digest())
    return "sha256:" + h.hexdigest()
