"""``spill bundle``: one file holding a project, its model files and optionally its run state.
``pack`` (``spill bundle DIR PATH [--with-state] [--state URI] [--wait]``) writes it
(``bundle.pack``; the format: ``bundle.format``); ``verify`` (``--verify PATH``) checks the manifest
and every checksum, one line per bad file (``bundle.read``); ``install`` (``--install PATH DIR
[--force]``) installs it with no network: the project into ``DIR``, the model files into
``SPILL_HOME/models`` where the same names find them (``bundle.install``). Each says a pre-run line
and progress on stderr and returns its one-row result, which ``spill.cli.bundle`` prints as a table
or ``--json``. No engine is imported: models resolve through ``spill.models``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from spill.console import note, progress
from spill.control.keys import current
from spill.errors import UsageError
from spill.ground.paths import STATE_DIR
from spill.project.bundle import pack as bp
from spill.project.bundle.format import BundleError
from spill.project.bundle.install import install as run_install
from spill.project.bundle.read import open_bundle
from spill.project.bundle.read import verify as check
from spill.project.remote import checkout
from spill.store.location import Location


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 1e6 / max(seconds, 1e-9):.0f} MB/s"


def _project(where: Location, state: Location | None) -> tuple[Path, Location]:
    """(the project folder to read, its state): a local folder, or a project at a URI read from
    its working copy (``spill.project.remote``) with its state at the URI."""
    if where.on_disk() is None:
        root, there = checkout(where)
        return root, state or there
    where = where.absolute
    root = Path(where.path)
    if not (root / "spill.yaml").is_file():
        raise UsageError(f"{root} holds no spill.yaml; give a project folder")
    return root, state or where.join(STATE_DIR)


def pack(
    where: Location,
    path: Path,
    *,
    state: Location | None = None,
    with_state: bool = False,
    wait: bool = False,
    force: bool = False,
    with_exports: bool = False,
) -> dict[str, Any]:
    """Write the bundle of the project at ``where`` to ``path``: its one-row result (the
    state's merged models under ``exports/`` only ``with_exports``)."""
    if path.exists() and not force:
        raise BundleError(f"{path} exists; give another PATH, or --force to replace it")
    if not path.parent.is_dir():
        raise BundleError(f"{path.parent} is not a folder; create it first")
    root, state = _project(where, state)
    t0 = time.perf_counter()
    project, contents = bp.collect(root, state, with_state, wait, with_exports)
    n_models = len(contents.models)
    run = f" · run {contents.run['run']}" if contents.run else ""
    note(
        f"spill bundle · project {project.name} · {len(contents.items)} files, "
        f"{n_models} model{'s' * (n_models != 1)}{run} · {contents.bytes / 1e6:.1f} MB -> {path}"
    )
    doc = bp.manifest(project, contents)
    size = bp.write(path, doc, contents.items)
    if contents.run is not None and current(state) != contents.run:
        path.unlink(missing_ok=True)
        raise BundleError(
            f"run {contents.run['run']} at {state} changed while bundling; bundle again"
        )
    seconds = time.perf_counter() - t0
    return {
        "bundle": str(path),
        "files": len(contents.items),
        "models": ", ".join(m["name"] for m in contents.models) or "-",
        "run": contents.run["run"] if contents.run else "-",
        "MB": round(size / 1e6, 1),
        "seconds": round(seconds, 2),
        "rate": _rate(size, seconds),
    }


def verify(path: Path) -> dict[str, Any]:
    """Check the bundle at ``path``: its one-row result, ``bad`` the number of ``problems``
    (one line per bad file)."""
    t0 = time.perf_counter()
    b = open_bundle(path)
    note(f"spill bundle --verify · {path} · {len(b.entries)} files, {b.bytes / 1e6:.1f} MB")
    with progress(b.bytes, "verifying", unit="B") as bar:
        bar.unit_scale = True
        problems = check(b, bar)
    seconds = time.perf_counter() - t0
    return {
        "bundle": str(path),
        "files": len(b.entries),
        "bad": len(problems),
        "MB": round(b.bytes / 1e6, 1),
        "seconds": round(seconds, 2),
        "rate": _rate(b.bytes, seconds),
        "problems": problems,
    }


def install(path: Path, dest: Path, force: bool = False) -> dict[str, Any]:
    """Install the bundle at ``path``: the project into ``dest``, its models into the cache;
    the one-row result."""
    t0 = time.perf_counter()
    note(f"spill bundle --install · {path} -> {dest} and the model cache")
    result = run_install(path, dest, force)
    seconds = time.perf_counter() - t0
    result.update(seconds=round(seconds, 2), rate=_rate(result["bytes"], seconds))
    return result
