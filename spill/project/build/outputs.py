"""Stage outputs: files published under the state location, what ``state.json`` records about
them (relative path -> sha256, size, and mtime on local states), make's check that they are
still that (only a file whose mtime moved is hashed; remote states: existence and size), and
their restoration from the stage's committed state, never from an engine.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

from spill.control.place import Place
from spill.errors import StoreError
from spill.store.fs import exists, files_under, get_bytes, join, put_bytes, stat
from spill.store.location import Location


def sha256_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _files(uri: str) -> list[str]:
    """Every file under ``uri`` (or ``uri`` itself), relative to it, sorted; hidden names are a
    killed writer's temporary files, never outputs."""
    return [f for f in files_under(uri) if not any(part.startswith(".") for part in f.split("/"))]


def record(root: Location, where: str) -> dict[str, dict[str, Any]]:
    """What ``state.json`` keeps about the outputs at ``where`` (relative to ``root``), read back
    from the store."""
    out = {}
    for rel in _files(join(root, where)):
        path = f"{where}/{rel}" if rel else where
        uri = join(root, path)
        data = get_bytes(uri)
        found = stat(uri)
        entry: dict[str, Any] = {"sha256": sha256_of(data), "size": len(data)}
        if found is not None and found[1] is not None:
            entry["mtime_ns"] = found[1]
        out[path] = entry
    return out


def problem(root: Location, where: str, outputs: Mapping[str, Any] | None, marker: str = "") -> str:
    """What is wrong with the outputs recorded at ``where`` (``adapters/toy missing``), or ``""``;
    a record without ``outputs`` is probed by the existence of ``where/marker``."""
    if outputs is None:  # recorded before outputs were: probe by existence
        probe = join(root, where, marker) if marker else join(root, where)
        return "" if exists(probe) else f"{where} missing"
    if not outputs:
        return ""
    for path, want in sorted(outputs.items()):
        uri = join(root, path)
        got = stat(uri)
        if got is None:
            return f"{where} missing" if not exists(join(root, where)) else f"{path} missing"
        if got[0] != want["size"]:
            return f"{path} changed"
        if got[1] is None or got[1] == want.get("mtime_ns"):
            continue
        if sha256_of(get_bytes(uri)) != want["sha256"]:
            return f"{path} changed"
    return ""


def restore_adapter(
    where: Place, exported: str, root: Location, out: str, recorded: Mapping[str, Any] | None
) -> None:
    """Publish the adapter at ``root/out`` again: copied from ``exported`` (the tune job's own
    export) when that still holds the recorded bytes, else exported again from the final
    checkpoint the tune job's place ``where`` points at."""
    prefix = f"{out}/"
    intact = bool(recorded) and all(
        stat(join(exported, path.removeprefix(prefix))) is not None
        and sha256_of(get_bytes(join(exported, path.removeprefix(prefix)))) == want["sha256"]
        for path, want in recorded.items()
    )
    if not intact:
        _export_final(where)
    copy_tree(exported, join(root, out))


def copy_tree(src: str, dst: str) -> None:
    """Copy every file under ``src`` to ``dst`` through the store (any scheme to any scheme)."""
    files = _files(src)
    if not files:
        raise StoreError(f"{src} is missing; the tune stage did not publish its adapter")
    for rel in files:
        put_bytes(join(dst, rel), get_bytes(join(src, rel)))


def _export_final(where: Place) -> None:
    """Export the adapter of the final tune checkpoint as the tune job does at its end."""
    from spill.jobs.adapter_files import publish_adapter
    from spill.models.lora import LoraConfig
    from spill.payloads.checkpoint import latest_checkpoint, load_checkpoint

    ckpt = latest_checkpoint(where)
    if ckpt is None:
        raise StoreError(f"{where.uri} holds no committed checkpoint")
    params, _, st = load_checkpoint(ckpt)
    steps = st["hyperparameters"]["steps"]
    if st["step"] != steps:
        raise StoreError(f"{ckpt.uri} is step {st['step']}, not the final step {steps}")
    a = st["adapter"]
    lora = LoraConfig(a["rank"], a["alpha"], a["dropout"], tuple(a["targets"]))
    layers = 1 + max(int(k.split(".")[1]) for k in params)  # every layer carries the adapter
    losses = [float("nan") if x is None else x for x in st["losses"]]
    model = st["model"]
    publish_adapter(
        where.uri,
        params,
        lora,
        model["id"],
        model["fingerprint"],
        layers,
        losses,
        model.get("files"),
    )


def restore_rows(where: Place, dest: str, ids: list, shape: Callable[[dict], dict]) -> None:
    """Write the rows file ``dest`` again from the committed segments of the row job at
    ``where`` (a place): one ``shape(row)`` line per id of ``ids``, in that order."""
    from spill.payloads.rows import restore

    got = restore(where)
    by_id = dict(zip(got.done, got.rows, strict=True))
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise StoreError(
            f"{where.uri} holds {len(ids) - len(missing)} of {len(ids)} committed rows"
        )
    data = "".join(json.dumps(shape(by_id[i]), ensure_ascii=False) + "\n" for i in ids)
    put_bytes(dest, data.encode("utf-8"))
