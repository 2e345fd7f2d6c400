"""``spill bundle --install PATH DIR`` (``install``): a checked bundle into a project folder and the
model cache. Nothing is written until ``open_bundle`` accepted the bundle
(``spill.project.bundle.read``) and ``DIR`` passed its checks. Files land in temporary folders and
are renamed into place only when every hash matched, so ``DIR`` is either as it was or whole. A
bundled run installs as a copy (``ownership.as_copy``), and so does each sweep job's run
(``_install_jobs``): the original stays the one place that continues it. What a user sees:
docs/bundle.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

from spill.console import note, progress
from spill.control.keys import current, parse
from spill.control.ownership import as_copy, busy, is_held
from spill.ground.paths import STATE_DIR, models_dir, spill_home
from spill.ground.validate import validate
from spill.project.bundle import installed
from spill.project.bundle import models as bundle_models
from spill.project.bundle.format import BundleError, Hasher
from spill.project.bundle.installed import FILE, read
from spill.project.bundle.read import Bundle, damaged, free_space_ok, open_bundle
from spill.project.move.checks import SWEEP
from spill.store.location import location


def _check_dest(dest: Path, force: bool, bundle: Path) -> bool:
    """Whether ``dest`` holds a previous install that ``--force`` replaces; refused in one line:
    a file, a folder inside or above ``SPILL_HOME``, one inside a run's state location, one that
    holds the bundle itself, and (even with ``--force``) a non-empty folder no bundle installed."""
    if dest.exists() and not dest.is_dir() or dest.is_symlink():
        raise BundleError(f"{dest} exists and is not a folder; give --install another DIR")
    real = Path(os.path.realpath(dest))
    home = Path(os.path.realpath(spill_home()))
    if real.is_relative_to(home) or home.is_relative_to(real):
        raise BundleError(
            f"{dest} is {'inside' if real.is_relative_to(home) else 'above'} SPILL_HOME ({home}), "
            "which spill manages; install the project somewhere else"
        )
    for above in (real, *real.parents):
        if (above / "runs" / "current.json").exists():
            raise BundleError(
                f"{dest} lies inside {above}, the state of a run; install the project elsewhere"
            )
    if not (dest.exists() and any(dest.iterdir())):
        return False
    if not force:
        raise BundleError(
            f"{dest} is not empty; give an empty or new DIR, or --force to replace it"
        )
    if Path(os.path.realpath(bundle)).is_relative_to(real):
        raise BundleError(f"--force would replace {dest}, which holds the bundle {bundle}; refused")
    if read(dest) is None:
        raise BundleError(
            f"--force replaces only a project a bundle installed, and {dest} has no {FILE}; "
            "give an empty or new DIR"
        )
    _refuse_live(dest)
    return True


def _check_lengths(b: Bundle, dest: Path) -> None:
    """A file whose installed path would be longer than the file system takes is refused
    before anything is written (the bundle's own limits do not know ``DIR``)."""
    limit = 4096
    with contextlib.suppress(OSError, ValueError):
        limit = os.pathconf(_existing(dest.parent), "PC_PATH_MAX")
    for e in b.entries:
        if e.role == "model":
            continue
        rel = e.path.removeprefix("project/") if e.role == "project" else e.path
        full = dest / (rel if e.role == "project" else f"{STATE_DIR}/{rel[len('state/') :]}")
        if len(os.fsencode(full)) >= limit:
            raise BundleError(
                f"{b.path}: {e.path} would be installed at a path of {len(os.fsencode(full))} "
                f"bytes, longer than this file system takes ({limit}); give a shorter DIR"
            )


def _refuse_live(dest: Path) -> None:
    """A previous install whose run a live process owns is not replaced under it."""
    state = location(dest / STATE_DIR)  # the folder installed into: a state enters here
    try:
        doc = current(state)
    except Exception:  # a damaged state: nothing live can hold it
        return
    if doc is not None and is_held(doc):
        raise busy(doc, state, f"; --force would replace {dest} under it")


def _mkdirs(path: Path, made: list[Path]) -> None:
    """``mkdir -p``, remembering the folders it created (removed again on failure)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        d.mkdir()
        made.append(d)


# ``bundle_models`` decides where each model goes. Every entry is copied and hashed as it lands
# (``bundle_format.Hasher.copy_into``) into two temporary folders, ``.<DIR name>.install-<random>``
# beside ``DIR`` and ``SPILL_HOME/models/.bundle-install-<random>``; files not written are hashed
# all the same.
def _extract(b: Bundle, targets: dict[str, Path], bar) -> dict[str, list]:
    """Copy every entry named in ``targets`` to its temporary path, hashing what was written, and
    hash the others (model files the cache has or its source made) without writing them; a
    mismatch is refused, named. The files are fsynced together at the end (their writeback
    started as they were copied), before anything is renamed into place."""
    hasher = Hasher()
    keys: dict[str, list] = {}
    written: list[Path] = []
    try:
        with open(b.path, "rb", buffering=0) as src:
            for e in sorted(b.entries, key=lambda e: e.offset):
                target = targets.get(e.path)
                if target is None:
                    src.seek(e.offset)
                    got, sha = hasher.copy(src, None, e.size)
                    if got != e.size or sha != e.sha256:
                        raise BundleError(
                            f"{b.path}: {damaged(e, sha)}; nothing was installed (the cache's "
                            "own copy of the file is untouched)"
                        )
                    bar.update(e.size)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "x+b", buffering=0) as out:
                    written.append(target)
                    got, sha = hasher.copy_into(src, e.offset, out, e.size)
                if got != e.size or sha != e.sha256:
                    raise BundleError(f"{b.path}: {damaged(e, sha)}; nothing was installed")
                st = os.stat(target)
                keys[e.path] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
                bar.update(e.size)
    finally:
        hasher.close()
    for path in written:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return keys


def _targets(b: Bundle, dest_tmp: Path, model_tmp: Path, placements: list) -> dict[str, Path]:
    """Entry path -> where it is written: the project's and the state's files into the project
    folder, the files of each new own model folder into ``model_tmp/<n>/``."""
    out = {}
    for e in b.entries:
        if e.role == "project":
            out[e.path] = dest_tmp / e.path.removeprefix("project/")
        elif e.role == "state":
            out[e.path] = dest_tmp / STATE_DIR / e.path.removeprefix("state/")
    for n, p in enumerate(placements):
        if p.write:
            for path, f in zip(p.entries(), p.pin["files"], strict=True):
                out[path] = model_tmp / str(n) / f["name"]
    return out


def _write_json(path: Path, doc: dict[str, Any], schema: str) -> None:
    validate(doc, schema, where=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "xb") as f:  # the byte format of spill.store.cas.Store.put
        f.write(json.dumps(doc, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n")
        os.fsync(f.fileno())


def _install_run(b: Bundle, dest: Path, dest_tmp: Path) -> None:
    run = b.manifest["run"]
    control, runs = as_copy(run["control"], location(dest / STATE_DIR))
    _write_json(dest_tmp / STATE_DIR / "runs" / run["id"] / "control.json", control, "control")
    _write_json(dest_tmp / STATE_DIR / "runs" / "current.json", runs, "runs")
    _install_jobs(b, dest, dest_tmp)


def _install_jobs(b: Bundle, dest: Path, dest_tmp: Path) -> None:
    """Each sweep job's run becomes a copy as the bundled run does: its ``runs/`` holds its
    current control object (``as_copy``) and a run list naming it alone, nothing else."""
    sweep = dest_tmp / STATE_DIR / SWEEP
    for job in sorted(sweep.iterdir()) if sweep.is_dir() else []:
        runs = job / "runs"
        listing = runs / "current.json"
        if not listing.is_file():
            shutil.rmtree(runs, ignore_errors=True)  # no run to copy: a build starts one
            continue
        where = f"{b.path}: state/{SWEEP}/{job.name}/runs"
        rid = parse(listing.read_bytes(), "runs", f"{where}/current.json")["current"]
        control = runs / rid / "control.json"
        doc = parse(control.read_bytes(), "control", str(control)) if control.is_file() else None
        if doc is None or doc["run"] != rid:
            raise BundleError(f"{where} names run {rid}, which it does not carry; bundle again")
        copy, runlist = as_copy(doc, location(dest / STATE_DIR / SWEEP / job.name))
        shutil.rmtree(runs)
        _write_json(runs / rid / "control.json", copy, "control")
        _write_json(listing, runlist, "runs")


def _free_space(b: Bundle, dest: Path, models: Path) -> None:
    """Refuse, naming the bytes, an install that cannot fit where the file system says (every
    model file counted, as if none were cached yet)."""
    project = sum(e.size for e in b.entries if e.role != "model")
    model = b.bytes - project
    at = _existing(dest.parent), _existing(models)
    need = {at[0]: project, at[1]: model}
    if at[0].stat().st_dev == at[1].stat().st_dev:
        need = {at[0]: b.bytes}
    for where, nbytes in need.items():
        if nbytes and not free_space_ok(where, nbytes):
            raise BundleError(
                f"not enough free space for {nbytes / 1e6:.0f} MB at {where}; free some space "
                "and install again"
            )


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def install(path: Path, dest: Path, force: bool = False) -> dict[str, Any]:
    """Install the bundle at ``path`` into ``dest`` and the model cache; returns a summary."""
    b = open_bundle(path)
    if b.problems:
        more = f" (and {len(b.problems) - 1} more: spill bundle --verify lists them)"
        raise BundleError(f"{path}: {b.problems[0]}{more if len(b.problems) > 1 else ''}")
    dest = Path(os.path.abspath(dest))
    replace = _check_dest(dest, force, Path(path))
    _check_lengths(b, dest)
    models = models_dir()
    _free_space(b, dest, models)
    made: list[Path] = []
    token = secrets.token_hex(4)
    dest_tmp = dest.parent / f".{dest.name}.install-{token}"
    model_tmp = models / f".bundle-install-{token}"
    try:
        _mkdirs(dest.parent, made)
        _mkdirs(models, made)
        model_tmp.mkdir()
        placements = bundle_models.plan(b.manifest, model_tmp, _reader(b), note)
        dest_tmp.mkdir()
        with progress(b.bytes, "installing", unit="B") as bar:
            bar.unit_scale = True
            keys = _extract(b, _targets(b, dest_tmp, model_tmp, placements), bar)
        if b.manifest["run"] is not None:
            _install_run(b, dest, dest_tmp)
        own = {p.pin["name"]: p for p in placements if p.how == "own"}
        installed.write(dest_tmp, _record(b, own, models))
        placed = sum(
            bundle_models.place(p, model_tmp / str(n), keys) for n, p in enumerate(placements)
        )
        if replace:
            old = dest.parent / f".{dest.name}.replaced-{token}"
            os.rename(dest, old)
            os.rename(dest_tmp, dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            if dest.exists():
                dest.rmdir()  # empty: checked above
            os.rename(dest_tmp, dest)
    except BaseException:
        shutil.rmtree(dest_tmp, ignore_errors=True)
        shutil.rmtree(model_tmp, ignore_errors=True)
        for d in reversed(made):
            try:
                d.rmdir()  # only what we created, and only when still empty
            except OSError:
                pass
        raise
    shutil.rmtree(model_tmp, ignore_errors=True)
    for name, p in own.items():
        note(f"{name}: the bundle's copy is {p.folder}, for this project only ({p.why})")
    run = b.manifest["run"]
    return {
        "installed": str(dest),
        "files": len(b.entries),
        "bytes": b.bytes,
        "models": [m["name"] for m in b.manifest["models"]],
        "model_files_written": placed,
        "model_files_kept": sum(len(p.pin["files"]) for p in placements) - placed,
        "models_own": sorted(own),
        "run": run["id"] if run else None,
    }


def _reader(b: Bundle):
    """``read(entry path) -> bytes`` of a bundle whose files are whole (checked)."""
    at = {e.path: e for e in b.entries}

    def read(name: str) -> bytes:
        e = at[name]
        with open(b.path, "rb") as f:
            f.seek(e.offset)
            return f.read(e.size)

    return read


def _record(b: Bundle, own: dict[str, Any], models: Path) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "kind": "spill-installed-bundle",
        "bundle": b.path.name[:255],
        "manifest_sha256": b.manifest_sha256,
        "installed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "models": {
            name: {"folder": p.folder.relative_to(models).as_posix(), "why": p.why}
            for name, p in own.items()
        },
    }
