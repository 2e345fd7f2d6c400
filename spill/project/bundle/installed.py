"""The record a bundle install leaves in its project folder: ``.spill-bundle.json`` (``read``,
``write``, ``model_folder``). It names the bundle (file name, the manifest's sha256) and every
bundled model that could not take its own name in the model cache, with the folder of its own
(``bundled/<key>``) that this project resolves the name to: its builds (and a bundle made of it
again) load that folder, while every other project naming the same model gets the cache's own.
``--install --force`` replaces only a folder holding this record (a previous install).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from spill.errors import ModelNotFound, StoreError
from spill.ground.paths import models_dir
from spill.ground.validate import SchemaInvalid, parse_json, validate

# The name is hidden, so it is no project file: composing, ``move`` and ``bundle`` never carry it,
# and a moved project resolves its models afresh (a run's weight fingerprint then says whether they
# are the same).
FILE = ".spill-bundle.json"
KIND = "spill-installed-bundle"


def read(root: Path | str) -> dict[str, Any] | None:
    """The project's record (validated), or None when no bundle installed it."""
    path = Path(root) / FILE
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise StoreError(f"{path}: cannot be read ({e.strerror}); fix its permissions") from None
    try:
        doc = parse_json(raw)
        validate(doc, "installed-bundle", where=str(path))
    except (ValueError, SchemaInvalid) as e:
        raise StoreError(
            f"{path} is damaged ({str(e)[:120]}); install the bundle again, or delete the file "
            "to load the models the cache's own names give"
        ) from None
    return doc


def model_folder(root: Path | str, name: str | None) -> str | None:
    """The cache folder this project loads ``name`` from, when a bundle install pinned one."""
    doc = read(root) if name else None
    pin = (doc or {}).get("models", {}).get(name)
    if pin is None:
        return None
    folder = models_dir() / pin["folder"]
    if not (folder / "config.json").is_file():
        raise ModelNotFound(
            f"{name}: this project was installed with the bundle's own copy at {folder}, which "
            f"is gone; install the bundle again, or delete {Path(root) / FILE} to use the cache's"
        )
    return str(folder)


def encode(doc: dict[str, Any]) -> bytes:
    validate(doc, "installed-bundle", where=FILE)
    return json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"


def write(root: Path, doc: dict[str, Any]) -> None:
    """Write the record into the (not yet renamed) project folder ``root``."""
    data = encode(doc)
    with open(root / FILE, "xb") as f:
        f.write(data)
        os.fsync(f.fileno())
