"""``spill bundle --install PATH DIR``: a checked bundle into a project folder and the model cache.

Nothing is written until ``open_bundle`` accepted the bundle's structure and every file is
whole (``spill.project.bundle_read``). Then every entry is copied by the kernel and the bytes
written are hashed as they land (``bundle_format.Hasher.copy_into``), into two
temporary folders: ``.<DIR name>.install-<random>`` beside ``DIR`` (the project, its state under
``.spill/``) and ``SPILL_HOME/models/.bundle-install-<random>`` (model files); a damaged file
removes both and is refused, named. Only when every hash matched are the model files renamed
into their cache folders (a file already there with the same sha256 is not copied at all) and
the project folder renamed to ``DIR``, so ``DIR`` is either absent, as it was, or whole.

``DIR`` must be absent or empty; ``--force`` replaces a non-empty one (the old folder is moved
aside, the new one renamed in, the old one removed), but never ``/``, the home folder or a folder
holding ``SPILL_HOME``. A bundled run installs as a copy (``spill.control.runs.as_copy``): its
control object and run list are written beside its files, so ``spill build DIR`` refuses to
continue it and ``spill build DIR --new-run`` forks it. Each model folder gets a cache record
(``spill-source.json``) of the files' hashes, so the first build checks them by stat alone.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

from spill.console import progress
from spill.paths import STATE_DIR
from spill.project.bundle_format import BundleError, Hasher
from spill.project.bundle_read import Bundle, Entry, damaged, free_space_ok, open_bundle

_MARKER_SOURCE = {"tiny": "tiny", "gguf": "gguf", "hub": "hub", "imported": "bundle"}


def _check_dest(dest: Path, force: bool) -> bool:
    """Whether ``dest`` holds anything (refused unless ``force``, and never a folder that
    matters more than a project: ``/``, home, one holding SPILL_HOME)."""
    if dest.exists() and not dest.is_dir() or dest.is_symlink():
        raise BundleError(f"{dest} exists and is not a folder; give --install another DIR")
    full = dest.exists() and any(dest.iterdir())
    if not full:
        return False
    if not force:
        raise BundleError(
            f"{dest} is not empty; give an empty or new DIR, or --force to replace it"
        )
    from spill.paths import spill_home

    real = Path(os.path.realpath(dest))
    keep = [Path("/"), Path(os.path.realpath(Path.home()))]
    if real in keep or Path(os.path.realpath(spill_home())).is_relative_to(real):
        raise BundleError(f"--force would replace {dest}, which holds more than a project; refused")
    return True


def _model_targets(b: Bundle, models: Path, force: bool) -> dict[str, tuple[Path, str | None]]:
    """model entry path -> (its cache path, the sha256 of a file already there, or None)."""
    from spill.hashing import file_sha256

    real = Path(os.path.realpath(models))
    out = {}
    for m in b.manifest["models"]:
        folder = models / m["folder"]
        where = Path(os.path.realpath(folder))
        if not where.is_relative_to(real):
            raise BundleError(f"{folder} leads outside the model cache {models}; refused")
        for f in m["files"]:
            target = folder / f["name"]
            have = None
            if target.is_symlink() or target.exists() and not target.is_file():
                raise BundleError(f"{target} exists and is not a plain file; remove it first")
            if target.is_file():
                have = file_sha256(target)
                if have != f["sha256"] and not force:
                    raise BundleError(
                        f"{target} holds other bytes than the bundle's (sha256 {have[:12]}.. vs "
                        f"{f['sha256'][:12]}..); run `spill models verify`, or --force to replace it"
                    )
            out[f"models/{m['folder']}/{f['name']}"] = (target, have)
    return out


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


def _extract(b: Bundle, dest_tmp: Path, model_tmp: Path, skip: set[str], bar) -> dict[str, list]:
    """Copy every entry into the temporary folders, hashing what was written; a mismatch is
    refused, named. The files are fsynced together at the end (their writeback started as they
    were copied), before anything is renamed into place."""
    hasher = Hasher()
    keys: dict[str, list] = {}
    written: list[Path] = []
    try:
        with open(b.path, "rb", buffering=0) as src:
            for e in sorted(b.entries, key=lambda e: e.offset):
                if e.path in skip:
                    bar.update(e.size)
                    continue
                target = _temp_path(e, dest_tmp, model_tmp)
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


def _temp_path(e: Entry, dest_tmp: Path, model_tmp: Path) -> Path:
    if e.role == "project":
        return dest_tmp / e.path.removeprefix("project/")
    if e.role == "state":
        return dest_tmp / STATE_DIR / e.path.removeprefix("state/")
    return model_tmp / e.path.removeprefix("models/")


def _write_json(path: Path, doc: dict[str, Any], schema: str) -> None:
    from spill.store.schemas import validate

    validate(doc, schema, where=str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "xb") as f:  # the byte format of spill.control.cas.Store.put
        f.write(json.dumps(doc, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n")
        os.fsync(f.fileno())


def _install_run(b: Bundle, dest: Path, dest_tmp: Path) -> None:
    from spill.control.runs import as_copy

    run = b.manifest["run"]
    control, runs = as_copy(run["control"], str(dest / STATE_DIR))
    _write_json(dest_tmp / STATE_DIR / "runs" / run["id"] / "control.json", control, "control")
    _write_json(dest_tmp / STATE_DIR / "runs" / "current.json", runs, "runs")


def _place_models(b: Bundle, targets: dict, model_tmp: Path, keys: dict, made: list) -> int:
    """Rename the verified model files into the cache and record their hashes there."""
    from spill.models.integrity import record

    placed = 0
    for m in b.manifest["models"]:
        hashed, moved = {}, False
        for f in m["files"]:
            name = f"models/{m['folder']}/{f['name']}"
            target, have = targets[name]
            if have != f["sha256"]:
                _mkdirs(target.parent, made)
                os.replace(model_tmp / m["folder"] / f["name"], target)
                moved, placed = True, placed + 1
            hashed[f["name"]] = (f["sha256"], keys.get(name))
        if moved:
            src = m["source"]
            fields = {
                k: src[k] for k in ("model_id", "revision", "family", "seed", "gguf") if k in src
            }
            folder = targets[f"models/{m['folder']}/{m['files'][0]['name']}"][0].parent
            record(
                folder, hashed=hashed, source=_MARKER_SOURCE[src["kind"]], name=m["name"], **fields
            )
    return placed


def install(path: Path, dest: Path, force: bool = False) -> dict[str, Any]:
    """Install the bundle at ``path`` into ``dest`` and the model cache; returns a summary."""
    from spill.paths import models_dir

    b = open_bundle(path)
    if b.problems:
        more = f" (and {len(b.problems) - 1} more: spill bundle --verify lists them)"
        raise BundleError(f"{path}: {b.problems[0]}{more if len(b.problems) > 1 else ''}")
    dest = Path(os.path.abspath(dest))
    replace = _check_dest(dest, force)
    models = models_dir()
    targets = _model_targets(b, models, force)
    skip = {n for n, (_, have) in targets.items() if have is not None and have == _sha(b, n)}
    need = sum(e.size for e in b.entries if e.path not in skip)
    if not free_space_ok(dest.parent if dest.parent.exists() else Path("/"), need):
        raise BundleError(f"not enough free space for {need / 1e6:.0f} MB beside {dest}")
    made: list[Path] = []
    token = secrets.token_hex(4)
    dest_tmp = dest.parent / f".{dest.name}.install-{token}"
    model_tmp = models / f".bundle-install-{token}"
    try:
        _mkdirs(dest.parent, made)
        _mkdirs(models, made)
        dest_tmp.mkdir()
        model_tmp.mkdir()
        with progress(b.bytes, "installing", unit="B") as bar:
            bar.unit_scale = True
            keys = _extract(b, dest_tmp, model_tmp, skip, bar)
        if b.manifest["run"] is not None:
            _install_run(b, dest, dest_tmp)
        placed = _place_models(b, targets, model_tmp, keys, made)
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
    run = b.manifest["run"]
    return {
        "installed": str(dest),
        "files": len(b.entries),
        "bytes": b.bytes,
        "models": [m["name"] for m in b.manifest["models"]],
        "model_files_written": placed,
        "model_files_kept": len(skip),
        "run": run["id"] if run else None,
    }


def _sha(b: Bundle, name: str) -> str:
    return next(e.sha256 for e in b.entries if e.path == name)
