"""Writing a bundle (``collect``, ``write``): what goes in (project files, the run's files, model
files) and the file. Every file is hashed before the file is written (the manifest comes first), and
its stat key is compared again after its bytes are copied, so a file that changes while bundling is
refused rather than recorded with a stale hash. A model outside the cache is refused. The bundle is
written beside ``PATH`` under a temporary name and renamed at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import spill
from spill.console import note, progress
from spill.control.keys import current
from spill.control.ownership import busy, is_held, refuse_moving
from spill.errors import ModelError, StoreError
from spill.ground.hashing import file_sha256
from spill.ground.paths import models_dir
from spill.models.cache import read_marker
from spill.project import config
from spill.project.build import record
from spill.project.build.stages import STAGES
from spill.project.bundle.format import (
    FORMAT,
    KIND,
    MANIFEST,
    BundleError,
    Hasher,
    bad_path,
    copy_plain,
    header,
    padding,
    trailer,
)
from spill.project.bundle.installed import model_folder
from spill.project.move.checks import sweep_jobs
from spill.project.sources import compose_key
from spill.store import snapshot
from spill.store.fs import filesystem, join
from spill.store.location import Location

SKIP_STATE = ("command.json",)  # a build's record of its command line names this machine's cwd
JOB_RUNS = re.compile(r"sweep/[^/]+/runs/.*")  # a sweep job's own control files


@dataclass
class Item:
    """One file to write: where it is, its entry name, and what was hashed."""

    source: str  # a local path or a URI
    path: str  # its name in the bundle
    role: str
    size: int
    sha256: str
    key: tuple | None = None  # local files: (size, mtime_ns, ctime_ns, inode) when hashed
    data: bytes | None = None  # a file written from memory (a sweep job's reduced control object)


@dataclass
class Contents:
    items: list[Item] = field(default_factory=list)
    models: list[dict[str, Any]] = field(default_factory=list)
    run: dict[str, Any] | None = None

    @property
    def bytes(self) -> int:
        return sum(i.size for i in self.items)


def _key(path: str) -> tuple:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def _local_item(path: str, name: str, role: str, sha: str | None = None) -> Item:
    key = _key(path)
    digest = sha or file_sha256(path)
    if sha is None and _key(path) != key:
        raise BundleError(f"{path} changed while it was hashed; bundle again when it is still")
    return Item(path, name, role, key[0], digest, key)


def _checked_name(rel: str, where: str) -> str:
    why = bad_path(rel)
    if why:
        raise BundleError(f"{where}: {rel!r} is {why}, which a bundle cannot carry; rename it")
    return rel


# The project is ``snapshot.project_files``.
def project_items(root: Path, state: Location) -> list[Item]:
    out = []
    for rel in snapshot.project_files(root, state):
        _checked_name(rel, str(root))
        out.append(_local_item(str(root / rel), "project/" + rel, "project"))
    return out


# The state (``--with-state``) is ``snapshot.state_files`` of the current run and its sweep jobs
# (each whole, as its own control object points; ``move_checks.sweep_jobs``) without
# ``command.json``, its control object's ``home`` reduced to ``a bundle from <host>``; of each job's
# ``runs/`` only its run list and its current control object go, that ``home`` reduced too (an
# install makes each a copy, as the run: ``bundle_install``).
def run_items(
    state: Location, wait: bool, exports: bool = False
) -> tuple[list[Item], dict[str, Any]]:
    """The run's files (its merged models too with ``exports``) and its control object, once
    no live owner holds it."""
    doc = current(state)
    if doc is None:
        raise BundleError(
            f"{state} holds no run; build the project first, or bundle without --with-state"
        )
    pause = 0.02
    while is_held(doc):
        if not wait:
            raise busy(doc, state)
        time.sleep(pause)
        pause = min(pause * 2, 0.5)
        doc = current(state) or doc
    if doc["status"] in ("transferred", "incoming", "quiescing"):
        refuse_moving(doc, state)

    jobs = sweep_jobs(state)
    controls = {f"{p}/runs/{d['run']}/control.json": d for p, d in jobs.items()}
    lists = {f"{p}/runs/current.json" for p in jobs}
    out, here = [], state  # parsed where the command began
    for rel in snapshot.state_files(state, doc, exports, jobs):
        if rel in SKIP_STATE or bad_path(rel):
            continue  # hidden names are a writer's leftovers, never part of a run
        if rel in controls:
            out.append(_control_item(controls[rel], "state/" + rel))
            continue
        if JOB_RUNS.fullmatch(rel) and rel not in lists:
            continue  # a job's lock file and older runs: an install writes its own, as for the run
        if (path := here.on_disk(rel)) is not None:
            out.append(_local_item(path, "state/" + rel, "state"))
        else:
            src = join(state, rel)
            size, sha = snapshot.digest(src)
            out.append(Item(src, "state/" + rel, "state", size, sha))
    return out, doc


def _reduced(doc: dict[str, Any]) -> dict[str, Any]:
    """A control object as a bundle carries it: its ``home`` (a path here) reduced."""
    doc = json.loads(json.dumps(doc))
    doc["home"] = f"a bundle from {doc['owner']['host']}"
    return doc


def _control_item(doc: dict[str, Any], name: str) -> Item:
    raw = json.dumps(_reduced(doc), sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"
    return Item(name, name, "state", len(raw), hashlib.sha256(raw).hexdigest(), data=raw)


def _source(resolved, marker: dict[str, Any]) -> dict[str, Any]:
    if isinstance(marker.get("bundle"), dict):  # a bundle's own copy: what that bundle claimed
        return dict(marker["bundle"]["source"])
    kind = {"tiny": "tiny", "gguf": "gguf", "hub": "hub"}.get(resolved.source, "imported")
    out: dict[str, Any] = {"kind": kind}
    if resolved.model_id:
        out["model_id"] = resolved.model_id
    if resolved.revision:
        out["revision"] = resolved.revision
    for k in ("family", "seed"):
        if k in marker:
            out[k] = marker[k]
    gguf = marker.get("gguf") or marker.get("file")
    if kind == "gguf" and isinstance(gguf, str):
        out["gguf"] = gguf.replace("\\", "/").rsplit("/", 1)[-1]  # its name only
    if kind == "gguf" and isinstance(marker.get("sha256"), str):
        out["gguf_sha256"] = marker["sha256"]  # the import's record of its GGUF file
    return out


# The models are each one a stage loads, resolved as a build resolves them and checked against their
# cache records.
def model_items(project) -> tuple[list[Item], list[dict[str, Any]]]:
    """The model files of every stage's model, each model pinned once (a model an install
    gave this project a folder of its own for is that folder, as the project's builds load)."""
    from spill.models.integrity import check, model_files, stat_key  # lazy: pulls numpy
    from spill.models.resolve import resolve_model

    users: dict[str, list[str]] = {}
    for stage in STAGES:
        name = stage.model(project)
        if name and stage.model_key not in users.setdefault(name, []):
            users[name].append(stage.model_key)
    cache = Path(os.path.realpath(models_dir()))
    items, pins = [], []
    for name, used_by in users.items():
        if "://" in name:
            raise BundleError(
                f"{used_by[0]}: {name} is staged from a URI, which an offline machine cannot "
                "reach; copy it into the model cache (`spill models import`) and name that"
            )
        resolved = resolve_model(name, model_folder(project.root, name), progress=note)
        folder = Path(resolved.folder)
        real = Path(os.path.realpath(folder))
        if not real.is_relative_to(cache):
            raise BundleError(
                f"{used_by[0]}: {name} is the folder {folder}, outside the model cache "
                f"({cache}); a bundle carries cached models only: import it there and name it"
            )
        rel = (
            folder.relative_to(models_dir()).as_posix()
            if folder.is_relative_to(models_dir())
            else real.relative_to(cache).as_posix()
        )
        records = check(folder, name) or {}  # a changed file is refused here, named
        verified = read_marker(folder).get("verified") or {}
        files = []
        for fname in model_files(folder):
            path = str(folder / fname)
            rec = records.get(fname)
            trusted = rec and verified.get(fname) == stat_key(folder / fname)
            item = _local_item(
                path, f"models/{rel}/{fname}", "model", rec["sha256"] if trusted else None
            )
            items.append(item)
            files.append({"name": fname, "size": item.size, "sha256": item.sha256})
        pin = {"name": name, "used_by": used_by, "folder": rel}
        pins.append({**pin, "source": _source(resolved, read_marker(folder)), "files": files})
        _checked_name(rel, name)
    return items, pins


def manifest(project, contents: Contents) -> dict[str, Any]:
    run = None
    if contents.run is not None:
        doc = _reduced(contents.run)
        run = {"id": doc["run"], "status": doc["status"], "control": doc}
    return {
        "schema_version": FORMAT,
        "kind": KIND,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "spill": spill.__version__,
        "project": {"name": project.name, "id": project.id},
        "bytes": contents.bytes,
        "files": [
            {"path": i.path, "role": i.role, "size": i.size, "sha256": i.sha256}
            for i in contents.items
        ],
        "models": contents.models,
        "run": run,
    }


def _copy(item: Item, out) -> None:
    if item.data is not None:
        out.write(item.data)
        return
    if item.key is None:  # a remote state file: hashed again while copied
        fs, path = filesystem(item.source)
        hasher = Hasher()
        try:
            with fs.open(path, "rb") as src:
                got, sha = hasher.copy(src, out, item.size)
        finally:
            hasher.close()
        if (got, sha) != (item.size, item.sha256):
            raise BundleError(f"{item.source} changed while bundling; bundle again")
        return
    with open(item.source, "rb", buffering=0) as src:
        got = copy_plain(src, out, item.size)
    if got != item.size or _key(item.source) != item.key:
        raise BundleError(f"{item.source} changed while bundling; bundle again when it is still")


def write(path: Path, doc: dict[str, Any], items: list[Item], show: bool = True) -> int:
    """Write the bundle to a temporary name beside ``path`` and rename it; returns its size."""
    raw = json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False).encode() + b"\n"
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb", buffering=0) as out:
            out.write(header(MANIFEST, len(raw)) + raw + padding(len(raw)))
            with progress(sum(i.size for i in items), "bundling", unit="B") as bar:
                bar.unit_scale = True
                for item in items:
                    out.write(header(item.path, item.size))
                    _copy(item, out)
                    out.write(padding(item.size))
                    bar.update(item.size)
            out.write(trailer(out.tell()))
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def project_config(root: Path, state: Location):
    """The project as ``compose(root)`` makes it: from the build's record when its compose key
    says nothing composition reads has changed (no Hydra, as a finished build), else composed."""
    try:
        doc = record.read(state)
    except StoreError:
        doc = None  # a damaged or foreign state says nothing; composing says it all
    if doc is not None and doc.get("compose_key") == compose_key(root):
        return config.from_record(doc["config"], root)
    return config.compose(root)


def collect(
    root: Path, state: Location, with_state: bool, wait: bool, exports: bool = False
) -> tuple[Any, Contents]:
    project = project_config(root, state)
    contents = Contents()
    try:
        contents.items += project_items(root, state)
        if with_state:
            items, contents.run = run_items(state, wait, exports)
            contents.items += items
        items, contents.models = model_items(project)
    except ModelError as e:
        raise BundleError(f"cannot bundle the models: {e}") from None
    contents.items += items
    return project, contents
