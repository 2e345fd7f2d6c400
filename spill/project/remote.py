"""A project at a URI (``spill build s3://bucket/proj``): its files checked out on this machine.

``spill move DIR s3://bucket/proj`` leaves a project there: its files (spill.yaml, data, group
options) beside its state under ``.spill/``. A build reads the project from a local working copy,
``SPILL_HOME/projects/<hash of the URI>/``, refreshed from the URI before every command (a file
whose size or sha256 differs is fetched again, one that is gone is removed), while the state
stays at ``<URI>/.spill``: the run has one place, the URI; the copy is only what composing reads.
``locate`` is where build, resume and status turn their ``DIR`` and ``--state`` into places.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from spill.errors import UsageError
from spill.ground.paths import STATE_DIR, spill_home
from spill.project.report.status import is_state
from spill.store.fs import exists, get_bytes
from spill.store.location import Location, location
from spill.store.snapshot import project_files


def locate(
    given: Location, state: Location | None, *, build: bool
) -> tuple[Location, Location | None]:
    """(the project folder or state location a command reads, its ``--state``), from ``DIR``
    and ``--state`` as the command line parsed them: file:///p is the folder /p (Hydra's sweep
    folder too); a project at a URI is checked out, its state at ``<URI>/.spill`` unless given;
    a state location is kept as it is, except by ``build`` (resume and status take those)."""
    state = state.plain if state else None
    where = given.plain  # a folder, as Hydra and Path take it
    if given.on_disk() is not None or not build and is_state(where):
        return where, state  # a local folder, or a state location
    if not exists(given.join("spill.yaml")):
        raise UsageError(f"{where} holds no spill.yaml; give a project's location")
    local, there = checkout(given)
    return location(local), state or there


def checkout(uri: Location) -> tuple[Path, Location]:
    """(the local working copy of the project at ``uri``, its state location)."""
    uri = uri.absolute  # no trailing /
    if not exists(uri.join("spill.yaml")):
        raise UsageError(f"{uri} holds no spill.yaml; give a project's location")
    local = spill_home() / "projects" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    wanted = set(project_files(uri))
    for d, _, names in os.walk(local):
        for n in names:
            rel = (Path(d) / n).relative_to(local).as_posix()
            if rel not in wanted:
                os.unlink(Path(d) / n)
    for rel in sorted(wanted):
        data = get_bytes(uri.join(rel))
        path = local / rel
        if path.is_file() and path.read_bytes() == data:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.part")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return local, uri.join(STATE_DIR)
