"""A stage's outputs: the files it publishes under the state location, what ``state.json``
records about them, the check that they are still what was recorded, and their restoration.

Outputs per stage: ``files/eval-base.jsonl`` (eval:base), ``files/teacher.jsonl`` (distill),
``adapters/<name>/`` (tune, every file under it) and ``files/eval.jsonl`` (eval). A finished
stage's record keeps ``outputs``: relative path -> sha256, size and (local states) mtime.

The check is make's, made cheap enough for the finished-build fast path: a file that is missing
or has another size has changed; one with the recorded size and mtime has not; only a file whose
mtime moved is hashed (a ``touch`` costs one hash, a same-size byte flip is found). Remote states
have no trustworthy mtime, so there the check is existence and size. A record written before
outputs were recorded (no ``outputs`` key) is checked by existence only.

Restoring uses the stage's own committed state, never an engine: the adapter is exported again
from the final tune checkpoint exactly as the tune job exports it (``publish_adapter``), or copied
from ``stages/tune/adapter`` when that still holds the recorded bytes; a graded or answered rows
file is written again from the committed row segments, in input order, as the job writes it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from spill.errors import StoreError
from spill.store.fs import exists, filesystem, get_bytes, is_local, join, put_bytes

FILES = {"eval:base": "eval-base.jsonl", "distill": "teacher.jsonl", "eval": "eval.jsonl"}
# the input a row stage reads, which gives the order of its rows
INPUTS = {"eval:base": "test.jsonl", "distill": "prompts.jsonl", "eval": "test.jsonl"}


def top(stage: str, name: str) -> str:
    """The output a stage publishes, relative to the state location."""
    return f"adapters/{name}" if stage == "tune" else f"files/{FILES[stage]}"


def _local(uri: str) -> str:
    return os.path.expanduser(uri.removeprefix("file://"))


def _stat(uri: str) -> tuple[int, int | None] | None:
    """(size, mtime_ns or None on remote stores) of a file, or None when there is none."""
    if is_local(uri):
        try:
            st = os.stat(_local(uri))
        except (OSError, ValueError):  # missing, or a damaged record's impossible name
            return None
        return st.st_size, st.st_mtime_ns
    fs, path = filesystem(uri)
    fs.invalidate_cache(path)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    return (int(info["size"]), None) if info.get("type") != "directory" else None


def _sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _files(uri: str) -> list[str]:
    """Every file under ``uri`` (or ``uri`` itself), relative to it, sorted."""
    if is_local(uri):
        base = _local(uri)
        if os.path.isfile(base):
            return [""]
        found = [
            os.path.relpath(os.path.join(d, f), base).replace(os.sep, "/")
            for d, _, names in os.walk(base)
            for f in names
        ]
    else:
        fs, path = filesystem(uri)
        fs.invalidate_cache(path)
        if fs.isfile(path):
            return [""]
        own = path.rstrip("/") + "/"
        found = [p.removeprefix(own) for p in fs.find(path)]
    # hidden names are a killed writer's temporary files, never outputs
    return sorted(f for f in found if not any(part.startswith(".") for part in f.split("/")))


def record(root: str, stage: str, name: str) -> dict[str, dict[str, Any]]:
    """What ``state.json`` keeps about a finished stage's outputs (read back from the store)."""
    out = {}
    where = top(stage, name)
    for rel in _files(join(root, where)):
        path = f"{where}/{rel}" if rel else where
        uri = join(root, path)
        data = get_bytes(uri)
        stat = _stat(uri)
        entry: dict[str, Any] = {"sha256": _sha(data), "size": len(data)}
        if stat is not None and stat[1] is not None:
            entry["mtime_ns"] = stat[1]
        out[path] = entry
    return out


def problem(root: str, stage: str, name: str, outputs: Mapping[str, Any] | None) -> str:
    """What is wrong with a finished stage's outputs (``adapters/toy missing``), or ``""``."""
    where = top(stage, name)
    if outputs is None:  # recorded before outputs were: probe by existence
        probe = join(root, where, "params.safetensors") if stage == "tune" else join(root, where)
        return "" if exists(probe) else f"{where} missing"
    if not outputs:
        return ""
    for path, want in sorted(outputs.items()):
        uri = join(root, path)
        got = _stat(uri)
        if got is None:
            return f"{where} missing" if not exists(join(root, where)) else f"{path} missing"
        if got[0] != want["size"]:
            return f"{path} changed"
        if got[1] is None or got[1] == want.get("mtime_ns"):
            continue
        if _sha(get_bytes(uri)) != want["sha256"]:
            return f"{path} changed"
    return ""


def source(root: str, stage: str, total: int) -> str:
    """The committed state a finished stage's outputs can be restored from, or ``""``."""
    from spill.project.state import probe

    done, _ = probe(root, stage)
    if done < total:
        return ""
    return f"tune step {done} checkpoint" if stage == "tune" else f"{done} committed rows"


def restore(
    root: str, stage: str, name: str, inputs: Path, recorded: Mapping[str, Any] | None
) -> None:
    """Publish a finished stage's outputs again from its committed state (see the module doc).

    ``inputs`` is the local folder holding the build's derived inputs (``test.jsonl``...).
    """
    from spill.project.state import stage_uri

    where = stage_uri(root, stage)
    if stage == "tune":
        _restore_adapter(root, where, name, recorded)
    else:
        _restore_rows(root, stage, where, inputs / INPUTS[stage])


def _restore_adapter(root: str, where: str, name: str, recorded: Mapping[str, Any] | None) -> None:
    exported = join(where, "adapter")
    prefix = f"adapters/{name}/"
    intact = bool(recorded) and all(
        _stat(join(exported, path.removeprefix(prefix))) is not None
        and _sha(get_bytes(join(exported, path.removeprefix(prefix)))) == want["sha256"]
        for path, want in recorded.items()
    )
    if not intact:
        _export_final(where)
    copy_tree(exported, join(root, "adapters", name))


def copy_tree(src: str, dst: str) -> None:
    """Copy every file under ``src`` to ``dst`` through the store (any scheme to any scheme)."""
    files = _files(src)
    if not files:
        raise StoreError(f"{src} is missing; the tune stage did not publish its adapter")
    for rel in files:
        put_bytes(join(dst, rel), get_bytes(join(src, rel)))


def _export_final(where: str) -> None:
    """Export the adapter of the final tune checkpoint as the tune job does at its end."""
    from spill.jobs.adapter_files import publish_adapter
    from spill.models.lora import LoraConfig
    from spill.store.checkpoint import latest_checkpoint, load_checkpoint

    ckpt = latest_checkpoint(where)
    if ckpt is None:
        raise StoreError(f"{where} holds no committed checkpoint")
    params, _, st = load_checkpoint(ckpt)
    steps = st["hyperparameters"]["steps"]
    if st["step"] != steps:
        raise StoreError(f"{ckpt.uri} is step {st['step']}, not the final step {steps}")
    a = st["adapter"]
    lora = LoraConfig(a["rank"], a["alpha"], a["dropout"], tuple(a["targets"]))
    layers = 1 + max(int(k.split(".")[1]) for k in params)  # every layer carries the adapter
    losses = [float("nan") if x is None else x for x in st["losses"]]
    model = st["model"]
    publish_adapter(where, params, lora, model["id"], model["fingerprint"], layers, losses)


def _same(record: dict) -> dict:
    return record


def _restore_rows(root: str, stage: str, where: str, input_path: Path) -> None:
    from spill.store.rows import restore as restore_rows

    got = restore_rows(where)
    by_id = dict(zip(got.done, got.rows, strict=True))
    shape: Callable[[dict], dict] = _same
    if stage == "distill":
        from spill.jobs.distill import training_row
        from spill.jobs.inputs import read_prompt_rows
        from spill.jobs.run import RunOptions

        rows = read_prompt_rows(input_path)
        prompts = {r.id: r for r in rows}
        chat = RunOptions().chat  # the build's distill runs with the default

        def shape(r: dict) -> dict:  # noqa: F811 - distill writes training rows, not records
            return training_row(prompts[r["id"]], r["output"], chat)

        ids = [r.id for r in rows]
    else:
        from spill.jobs.eval import read_eval_rows

        ids = [r.id for r in read_eval_rows(input_path)]
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise StoreError(f"{where} holds {len(ids) - len(missing)} of {len(ids)} committed rows")
    data = "".join(json.dumps(shape(by_id[i]), ensure_ascii=False) + "\n" for i in ids)
    put_bytes(join(root, "files", FILES[stage]), data.encode("utf-8"))
