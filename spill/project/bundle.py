"""``spill bundle``: one file holding a project, its model files and optionally its run state.

* ``spill bundle DIR PATH [--with-state] [--state URI] [--wait]`` writes the bundle
  (``spill.project.bundle_pack``; the format is in ``spill.project.bundle_format``);
* ``spill bundle --verify PATH`` checks the manifest and every checksum, one line per bad file
  (``spill.project.bundle_read``);
* ``spill bundle --install PATH DIR [--force]`` installs it with no network: the project into
  ``DIR``, the model files into ``SPILL_HOME/models`` where the same names find them
  (``spill.project.bundle_install``).

Each prints a pre-run line and progress on stderr, and a one-row table (or ``--json``) on
stdout. No engine is imported: bundling resolves models through ``spill.models`` only.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from spill.console import emit, note
from spill.errors import UsageError
from spill.paths import STATE_DIR
from spill.project.bundle_format import BundleError
from spill.store.fs import absolute


def add_parser(sub) -> None:
    """Add ``bundle`` to the ``spill`` subcommands."""
    p = sub.add_parser(
        "bundle",
        usage="spill bundle DIR PATH | --verify PATH | --install PATH DIR",
        help="pack a project and its model files into one file; verify or install one offline",
        description="Pack a project (its files, the model files its stages load, and with "
        "--with-state its run) into one file with a checksummed manifest; check one; install "
        "one on a machine without network.",
    )
    p.add_argument("args", nargs="*", metavar="DIR PATH")
    p.add_argument("--verify", metavar="PATH", help="check a bundle's manifest and checksums")
    p.add_argument("--install", nargs=2, metavar=("PATH", "DIR"), help="install a bundle")
    p.add_argument("--with-state", action="store_true", help="also carry the run state")
    p.add_argument("--state", metavar="URI", help="the state location (default DIR/.spill/)")
    p.add_argument(
        "--wait", action="store_true", help="with --with-state: wait for a live owner to finish"
    )
    p.add_argument(
        "--force", action="store_true", help="replace an existing PATH, or a non-empty DIR"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=command)


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 1e6 / max(seconds, 1e-9):.0f} MB/s"


def command(args: argparse.Namespace) -> int:
    modes = sum(bool(x) for x in (args.args, args.verify, args.install))
    if modes != 1 or args.args and len(args.args) != 2:
        raise UsageError(
            "give DIR PATH (write a bundle), --verify PATH or --install PATH DIR; see --help"
        )
    if (args.verify or args.install) and (args.with_state or args.state or args.wait):
        raise UsageError("--with-state, --state and --wait go with writing a bundle (DIR PATH)")
    if args.verify:
        return verify(Path(absolute(args.verify)), args.json)
    if args.install:
        path, dest = (Path(absolute(w)) for w in args.install)
        return install(path, dest, args.force, args.json)
    return pack(args.args[0], Path(args.args[1]), args, args.json)


def _project(where: str, state: str | None) -> tuple[Path, str]:
    """(the project folder to read, its state): a local folder, or a project at a URI read from
    its working copy (``spill.project.remote``) with its state at the URI."""
    from spill.store.fs import is_local

    if not is_local(where):
        from spill.project.remote import checkout

        root, there = checkout(where)
        return root, state or there
    root = Path(absolute(where))
    if not (root / "spill.yaml").is_file():
        raise UsageError(f"{root} holds no spill.yaml; give a project folder")
    return root, state or str(root / STATE_DIR)


def pack(where: str, path: Path, args: argparse.Namespace, as_json: bool) -> int:
    from spill.control.keys import current
    from spill.project import bundle_pack as bp

    if path.exists() and not args.force:
        raise BundleError(f"{path} exists; give another PATH, or --force to replace it")
    if not path.parent.is_dir():
        raise BundleError(f"{path.parent} is not a folder; create it first")
    root, state = _project(where, args.state)
    t0 = time.perf_counter()
    project, contents = bp.collect(root, state, args.with_state, args.wait)
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
    result: dict[str, Any] = {
        "bundle": str(path),
        "files": len(contents.items),
        "models": ", ".join(m["name"] for m in contents.models) or "-",
        "run": contents.run["run"] if contents.run else "-",
        "MB": round(size / 1e6, 1),
        "seconds": round(seconds, 2),
        "rate": _rate(size, seconds),
    }
    emit(result, as_json)
    return 0


def verify(path: Path, as_json: bool) -> int:
    from spill.console import progress
    from spill.project.bundle_read import open_bundle
    from spill.project.bundle_read import verify as check

    t0 = time.perf_counter()
    b = open_bundle(path)
    note(f"spill bundle --verify · {path} · {len(b.entries)} files, {b.bytes / 1e6:.1f} MB")
    with progress(b.bytes, "verifying", unit="B") as bar:
        bar.unit_scale = True
        problems = check(b, bar)
    seconds = time.perf_counter() - t0
    for line in problems:
        note(f"spill: error: {path}: {line}")
    result = {
        "bundle": str(path),
        "files": len(b.entries),
        "bad": len(problems),
        "MB": round(b.bytes / 1e6, 1),
        "seconds": round(seconds, 2),
        "rate": _rate(b.bytes, seconds),
    }
    if as_json:
        result["problems"] = problems
    emit(result, as_json)
    return 1 if problems else 0


def install(path: Path, dest: Path, force: bool, as_json: bool) -> int:
    from spill.project.bundle_install import install as run_install

    t0 = time.perf_counter()
    note(f"spill bundle --install · {path} -> {dest} and the model cache")
    result = run_install(path, dest, force)
    seconds = time.perf_counter() - t0
    result.update(seconds=round(seconds, 2), rate=_rate(result["bytes"], seconds))
    if not as_json:
        result["models"] = ", ".join(result["models"]) or "-"
        result["models_own"] = ", ".join(result["models_own"]) or "-"
        result["run"] = result["run"] or "-"
    emit(result, as_json)
    return 0
