"""Is a build up to date? The make-style check that lets a finished build answer at once.

The planner is a pure function of (stage specs, recorded state, stop point), and the specs
are a pure function of the composed config and the data. So when the compose key (a hash of
everything composition reads: spill.yaml, the project's group files, spill's shipped conf/,
the overrides, spill's version) and the data file's hash equal what the state recorded, and
the state recorded every stage done or skipped with its outputs still in place, the plan is
"all done" without composing, validating or reading the data: no Hydra, no jsonschema, no
dataclasses, no engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from spill import __version__
from spill.errors import DataError
from spill.ground.hashing import file_sha256
from spill.project.build.stages import finished as every_stage_finished
from spill.project.build.stages import get

FILE = "spill.yaml"


def data_sha256(path: Path | str) -> str:
    """The data file's hash as build states record it (``sha256:`` + hex)."""
    try:
        return "sha256:" + file_sha256(path)
    except FileNotFoundError:
        raise DataError(f"{path}: the project's data file is missing (data.file)") from None


def _project_files(root: Path) -> list[Path]:
    """spill.yaml and the project's own group options (``<root>/<group>/*.yaml``)."""
    found = [root / FILE]
    for sub in sorted(root.iterdir()):
        if sub.is_dir() and not sub.name.startswith("."):
            found += sorted(sub.glob("*.yaml"))
    return found


def compose_key(root: Path | str, overrides: Sequence[str] = ()) -> str:
    """A hash of everything composing ``root/spill.yaml`` reads; equal keys, equal configs."""
    import spill.conf

    root = Path(root).resolve()
    h = hashlib.sha256(f"spill {__version__}\0".encode())
    h.update(json.dumps(list(overrides)).encode())
    shipped = Path(spill.conf.__file__).parent
    for base, files in ((root, _project_files(root)), (shipped, sorted(shipped.rglob("*.yaml")))):
        for path in files:
            try:
                data = path.read_bytes()
            except OSError:
                data = b"(missing)"
            h.update(f"\0{base == root}:{path.relative_to(base).as_posix()}\0".encode())
            h.update(hashlib.sha256(data).digest())
    return "sha256:" + h.hexdigest()


def finished(doc: dict | None, key: str, root: Path, state_root: str) -> bool:
    """Whether the recorded build is complete, nothing it was made from has changed and every
    stage's outputs are still what it recorded (``Stage.problem``: stats, a hash only for a
    file whose mtime moved)."""
    if doc is None or doc.get("compose_key") != key:
        return False
    stages = doc.get("stages") or {}
    if not every_stage_finished(stages):
        return False
    data = Path(root) / doc["config"]["data"]["file"]
    if data_sha256(data) != doc["data"]["sha256"]:
        return False
    name = doc["project"]["name"]
    return not any(
        get(stage).problem(state_root, name, rec.get("outputs"))
        for stage, rec in stages.items()
        if rec["status"] == "done"
    )
