"""Where a bundle's models go in the model cache, decided before anything is written (``plan``,
``place``). A bundled model takes the folder its name resolves to (``provenance.home``) only on
proof that these are its bytes (``keep``, ``genuine``, ``verified``); anything else is ``own``:
``bundled/<key>``, which only the installed project's record (``spill.project.bundle.installed``)
points at. No file is ever added to or replaced in an existing folder; a new folder appears whole,
by one rename. docs/bundle.md, "Models are untrusted too".
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from spill.errors import ModelError
from spill.ground.hashing import file_sha256
from spill.ground.paths import models_dir
from spill.project.bundle.format import BundleError

OWN = "bundled"


# ``keep``: the folder already holds exactly these files; ``genuine``: no folder yet, and the name's
# own source, a tiny seed or the GGUF installed here, gives exactly these files; ``verified``: no
# folder yet, a hub snapshot, and the hub reports these files for its commit.
@dataclass
class Placement:
    pin: dict[str, Any]  # the manifest's model entry (validated)
    folder: Path  # where it lives in the cache afterwards
    how: str  # keep, genuine or own
    why: str = ""  # own: why not under its name
    made: Path | None = None  # genuine: the folder made from the source, renamed in at the end
    write: bool = False  # own: its files are written from the bundle (the folder is new)

    @property
    def files(self) -> dict[str, str]:
        return {f["name"]: f["sha256"] for f in self.pin["files"]}

    def entries(self) -> list[str]:
        return [f"models/{self.pin['folder']}/{f['name']}" for f in self.pin["files"]]


def key(files: dict[str, str]) -> str:
    """The content key of a model's files: sha256 of their sorted names and hashes."""
    text = "".join(f"{n}\0{s}\n" for n, s in sorted(files.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _held(folder: Path) -> dict[str, str] | None:
    """name -> sha256 of the model files ``folder`` holds (its records, once they check out, or
    hashed now), or None when it holds no model."""
    from spill.models.integrity import check, model_files  # lazy: pulls numpy

    if not (folder / "config.json").is_file():
        return None
    try:
        records = check(folder, str(folder), remember=False)  # the folder stays as it is
    except ModelError:
        return {}  # a changed or badly recorded folder holds nothing a bundle can match
    if records is not None:
        return {n: r["sha256"] for n, r in records.items()}
    return {n: file_sha256(folder / n) for n in model_files(folder)}


def _own(pin: dict[str, Any], why: str) -> Placement:
    files = {f["name"]: f["sha256"] for f in pin["files"]}
    folder = models_dir() / OWN / key(files)[:16]
    held = _held(folder)
    if held is not None and held != files:
        raise BundleError(
            f"{folder} holds other files than its content key says; run `spill models verify`, "
            "then delete it and install again"
        )
    return Placement(pin, folder, "own", why, write=held is None)


def plan(manifest: dict[str, Any], scratch: Path, read, progress) -> list[Placement]:
    """One placement per bundled model; a source check makes its folder under ``scratch`` (a
    temporary folder of the cache's file system, removed with everything left in it).
    ``read(entry path) -> bytes``: a small file's bytes as the bundle holds them."""
    from spill.models import provenance  # lazy: pulls numpy

    out: list[Placement] = []
    for n, pin in enumerate(manifest["models"]):
        name, source = pin["name"], pin["source"]
        files = {f["name"]: f["sha256"] for f in pin["files"]}
        where = provenance.home(name, source)
        if where is None:
            out.append(_own(pin, f"{name} names no fixed folder of the model cache"))
            continue
        held = _held(where)
        if held == files:
            out.append(Placement(pin, where, "keep"))
            continue
        if held is not None:
            out.append(_own(pin, f"the cache's {name} ({where}) holds other files"))
            continue
        if source["kind"] == "hub":
            out.append(_hub(pin, where, read))
            continue
        offered = sum(f["size"] for f in pin["files"])
        try:
            made = provenance.genuine(name, source, offered, scratch / f"source-{n}", progress)
        except provenance.Unverifiable as e:
            out.append(_own(pin, f"its bytes cannot be checked here: {e}"))
            continue
        if _held(made) == files:
            out.append(Placement(pin, where, "genuine", made=made))
            continue
        shutil.rmtree(made, ignore_errors=True)
        out.append(_own(pin, f"its files differ from what {name}'s own source gives here"))
    return out


def _hub(pin: dict[str, Any], where: Path, read) -> Placement:
    from spill.models import provenance  # lazy: pulls numpy

    files = {f["name"]: (f["size"], f["sha256"]) for f in pin["files"]}
    prefix = f"models/{pin['folder']}/"
    try:
        why = provenance.hub_differs(pin["name"], pin["source"], files, lambda f: read(prefix + f))
    except provenance.Unverifiable as e:
        return _own(pin, f"its bytes cannot be checked here: {e}")
    if why:
        return _own(pin, f"its files differ from what the hub reports ({why})")
    return Placement(pin, where, "verified", write=True)


def place(p: Placement, staged: Path | None, keys: dict[str, list]) -> int:
    """Put one model into the cache (``staged``: its files written from the bundle, for an own
    folder that is new); returns how many files were written."""
    from spill.models.integrity import record  # lazy: pulls numpy

    if p.how == "keep" or p.how == "own" and not p.write:
        return 0
    if p.how == "genuine":
        src = p.made
    else:
        assert staged is not None
        pin, source = p.pin, p.pin["source"]
        hashed = {
            f["name"]: (f["sha256"], keys.get(f"models/{pin['folder']}/{f['name']}"))
            for f in pin["files"]
        }
        fields = {k: source[k] for k in ("revision", "family", "seed") if k in source}
        if p.how == "verified":  # as the hub client's own download is recorded (hub._mark)
            fields.update(name=f"{source['model_id']}@{source['revision'][:12]}", source="hub")
        else:
            fields.update(name=pin["name"], source="bundle")
            fields["bundle"] = {"key": key(p.files), "source": source, "why": p.why}
        record(staged, hashed=hashed, model_id=source.get("model_id") or pin["name"], **fields)
        src = staged
    p.folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(src, p.folder)
    except OSError:
        if _held(p.folder) != p.files:  # else another install put the same files there first
            raise BundleError(
                f"{p.folder} appeared meanwhile with other files; install again"
            ) from None
        shutil.rmtree(src, ignore_errors=True)
        return 0
    p.made = None
    return len(p.pin["files"])
