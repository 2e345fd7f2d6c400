"""What a consistent copy of a run is made of: the files ``move`` and ``bundle`` carry.
``state_files`` names what a run at a control document ``doc`` is, so a copy taken while nobody
writes the run (``move`` owns it; ``bundle`` checks that nobody holds it) is exactly the run as its
pointers say it is; a symbolic link under the state that leads out of it is refused in one line,
never followed. ``project_files`` names a project folder's files: all but hidden entries
(``.spill/``, ``.git/``), links, and the state location when it lies inside. ``digest`` hashes a
file of any location (``spill.ground.hashing``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from spill.errors import StoreError
from spill.ground.hashing import stream_sha256
from spill.store.fs import files_under, is_temp, open_read
from spill.store.location import Location, location

_PAYLOAD_DIR = re.compile(r"(?:(.*)/)?payloads/([a-z]+-g\d+-s\d+-\d+)(?:/.*)?")
# "runs": the place's own control objects (a copy writes its own); "hydra": a sweep launcher's
# working folder (its multirun.yaml and job records name this machine's paths, host and pids,
# and nothing reads them once the sweep has returned)
SKIP_TOP = ("runs", "hydra")
EXPORTS = "exports"  # the export stage's merged models: carried only when asked for


def _pointed(doc: dict[str, Any]) -> set[str]:
    return {p for rels in doc.get("pointers", {}).values() for p in rels}


# A state location holds more than its run needs: payloads of aborted writes and of older
# generations wait for collection, temporary files of a killed writer lie beside the real ones, and
# ``runs/`` holds this place's control objects (a copy gets its own); the run is every file under
# the state except those. A sweep's jobs (``sweep/<job>/``, each a state of its own) are carried
# whole too: each job's payloads are kept as its own current control object points (``jobs``). Links
# out are refused because a copy carries the state's own bytes, not a file elsewhere on the machine.
def state_files(
    state: Location,
    doc: dict[str, Any],
    exports: bool = False,
    jobs: dict[str, dict[str, Any]] | None = None,
) -> list[str]:
    """``/``-separated paths, relative to ``state``, of the files the run ``doc`` consists of;
    the merged models under ``exports/`` only with ``exports`` (they are large, and a build
    makes them again where they are missing). ``jobs``: the current control object of each
    sweep job's state (``sweep/<job>``, relative to ``state``), whose payloads it points at are
    kept as the run's are."""
    keep = _pointed(doc)
    for prefix, job in (jobs or {}).items():
        keep |= {f"{prefix}/{p}" for p in _pointed(job)}
    skip = SKIP_TOP if exports else (*SKIP_TOP, EXPORTS)
    out = []
    for rel in files_under(state):
        if not rel or rel.split("/", 1)[0] in skip or is_temp(rel.rsplit("/", 1)[-1]):
            continue
        m = _PAYLOAD_DIR.fullmatch(rel)
        if m:
            folder = f"{m[1]}/payloads/{m[2]}" if m[1] else f"payloads/{m[2]}"
            if folder not in keep:
                continue
        out.append(rel)
    if state.local:
        _refuse_links_out(state.path, out)
    return out


def _refuse_links_out(root: str, rels: list[str]) -> None:
    """A one-line refusal of the first file among ``rels`` (under the local folder ``root``)
    that is a symbolic link leading out of ``root``."""
    real = os.path.realpath(root)
    for rel in rels:
        path = os.path.join(root, rel)
        if not os.path.islink(path):
            continue
        target = os.path.realpath(path)
        if not (target == real or target.startswith(real.rstrip(os.sep) + os.sep)):
            raise StoreError(
                f"{path} is a symbolic link to {os.readlink(path)}, outside {root}; a copy of "
                "the state never follows a link out of it: put the file itself there, or "
                "remove the link"
            )


def project_files(root: Path | Location, state: Location | None = None) -> list[str]:
    """A project folder's files (a local folder or a URI), ``/``-separated and relative to it:
    everything but hidden entries and, when it lies inside, the state location."""
    where = location(root)  # a Location as it is; a folder (a Path) parsed here
    if not where.local:  # its state is ``<root>/.spill``: hidden too
        return [r for r in files_under(where) if r and not any(p[0] == "." for p in r.split("/"))]
    root = Path(where.path).resolve()
    skip = Path(state.path).resolve() if state is not None and state.local else None
    out = []
    for d, dirs, names in os.walk(root):
        here = Path(d)
        dirs[:] = sorted(n for n in dirs if not n.startswith(".") and here / n != skip)
        for n in sorted(names):
            if not n.startswith(".") and not (here / n).is_symlink():
                out.append((here / n).relative_to(root).as_posix())
    return out


def digest(uri: str) -> tuple[int, str]:
    """(size, sha256 hex) of the file at ``uri``, local or on an object store."""
    with open_read(uri) as f:
        return stream_sha256(f)
