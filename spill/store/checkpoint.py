"""Tune checkpoints: ``<root>/ckpt/step-<n>/`` with ``params.safetensors``, ``opt.safetensors``,
``state.json`` and, written last, ``COMMIT``.

A directory counts only when its COMMIT (schema ``commit``) lists the size and sha256 of the
three files and the files match; ``state.json`` must match schema ``checkpoint-state``. Readers
ignore anything else with one logged line (warning level, so it is printed even when logging
is not configured). The next save removes what was ignored, writes the new directory, and only
after its COMMIT has landed deletes committed checkpoints older than the ``keep`` newest. A
save never deletes a committed checkpoint newer than the one it writes. One writer per state
location is assumed (a build's or a job's state location is its own; nothing here locks it).

Tensors are float32 and written with ``safetensors.numpy.save`` in name order, so equal inputs
give equal bytes and an equal COMMIT. Optimizer tensors are named ``m::<name>`` and
``v::<name>`` after the parameter they belong to.

A save hashes each existing directory at most once per process (a verdict is remembered per
COMMIT content), so saving every 50 steps does not re-download older checkpoints; readers always
hash what they return. ``latest_checkpoint`` keeps the verified bytes so that the following
``load_checkpoint`` does not read them twice.

Crash points for kill drills (``spill.store.drill``): ``ckpt-between-files``,
``ckpt-before-commit``, ``ckpt-after-commit``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from spill.errors import StoreError
from spill.store import drill
from spill.store.fs import basename, get_bytes, join, listdir, put_bytes, remove
from spill.store.schemas import SchemaInvalid, parse_json, validate

CKPT = "ckpt"
PARAMS = "params.safetensors"
OPT = "opt.safetensors"
STATE = "state.json"
COMMIT = "COMMIT"
FILES = (PARAMS, OPT, STATE)
KEEP = 2
SCHEMA_VERSION = 1
_STEP = re.compile(r"step-(\d+)")

log = logging.getLogger(__name__)

_good: dict[str, str] = {}  # step directory URI -> sha256 of a COMMIT verified in this process


class CheckpointInvalid(StoreError):
    """A checkpoint directory that is uncommitted, incomplete or damaged."""

    def __init__(self, uri: str, reason: str):
        super().__init__(f"checkpoint {uri}: {reason}")
        self.uri = uri
        self.reason = reason


@dataclass(frozen=True)
class Checkpoint:
    """A committed, verified checkpoint directory."""

    uri: str
    step: int
    state: dict[str, Any]
    commit: dict[str, Any]
    _blobs: dict[str, bytes] = field(default_factory=dict, repr=False, compare=False)


class Loaded(NamedTuple):
    params: dict[str, np.ndarray]
    opt: dict[str, np.ndarray]
    state: dict[str, Any]


def step_dir(root_uri: str, step: int) -> str:
    return join(root_uri, CKPT, f"step-{step}")


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _dump(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"


def _steps(root_uri: str) -> list[tuple[int, str]]:
    """``(step, directory URI)`` of every ``step-<n>`` under ``ckpt/``, oldest first."""
    base = join(root_uri, CKPT)
    found = [(int(m[1]), join(base, n)) for n in listdir(base) if (m := _STEP.fullmatch(n))]
    return sorted(found)


def _encode_tensors(tensors: Mapping[str, np.ndarray], what: str) -> bytes:
    from safetensors.numpy import save

    for name, a in tensors.items():
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            kind = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(
                f"{what} tensor {name!r} is {kind}; checkpoints hold float32 numpy arrays"
            )
    return save({k: np.ascontiguousarray(tensors[k]) for k in sorted(tensors)})


def _check_opt(params: Mapping[str, np.ndarray], opt: Mapping[str, np.ndarray]) -> None:
    for key, a in opt.items():
        kind, _, name = key.partition("::")
        if kind not in ("m", "v") or name not in params:
            raise ValueError(f"optimizer tensor {key!r} is not m::<param> or v::<param>")
        if a.shape != params[name].shape:
            raise ValueError(
                f"optimizer tensor {key!r} has shape {a.shape}, the parameter {params[name].shape}"
            )


def _verify(uri: str, step: int) -> Checkpoint:
    """Read and check a step directory; ``CheckpointInvalid`` says what is wrong with it.

    Failures to reach the store (credentials, network) propagate as ``StoreError``: they say
    nothing about the checkpoint, so nobody may delete it because of them.
    """
    _good.pop(uri, None)
    try:
        raw = get_bytes(join(uri, COMMIT))
    except FileNotFoundError:
        raise CheckpointInvalid(uri, "no COMMIT (its save was interrupted)") from None
    try:
        commit = parse_json(raw)
        validate(commit, "commit", where=join(uri, COMMIT))
    except (ValueError, SchemaInvalid) as e:
        raise CheckpointInvalid(uri, f"unreadable COMMIT ({e})") from None
    if commit["step"] != step:
        raise CheckpointInvalid(uri, f"COMMIT is for step {commit['step']}")
    blobs = {}
    for name, meta in commit["files"].items():
        try:
            data = get_bytes(join(uri, name))
        except FileNotFoundError:
            raise CheckpointInvalid(uri, f"{name} is missing") from None
        if len(data) != meta["size"]:
            raise CheckpointInvalid(uri, f"{name} is {len(data)} bytes, COMMIT says {meta['size']}")
        if (digest := _sha256(data)) != meta["sha256"]:
            raise CheckpointInvalid(
                uri, f"{name} has sha256 {digest[:12]}..., COMMIT says {meta['sha256'][:12]}..."
            )
        blobs[name] = data
    try:
        state = parse_json(blobs[STATE])
        validate(state, "checkpoint-state", where=join(uri, STATE))
    except (ValueError, SchemaInvalid) as e:
        raise CheckpointInvalid(uri, f"unusable state.json ({e})") from None
    if state["step"] != step:
        raise CheckpointInvalid(uri, f"state.json is for step {state['step']}")
    _good[uri] = _sha256(raw)
    return Checkpoint(uri, step, state, commit, blobs)


def _committed(uri: str, step: int) -> bool:
    """Whether ``uri`` is a good checkpoint, hashing it only if not yet verified here."""
    try:
        raw = get_bytes(join(uri, COMMIT))
    except FileNotFoundError:
        raw = None
    if raw is not None and _good.get(uri) == _sha256(raw):
        return True
    try:
        _verify(uri, step)
    except CheckpointInvalid as e:
        log.info("removing %s", e)
        return False
    return True


def _discard(uri: str) -> None:
    """Delete a step directory, COMMIT first, so a crash midway leaves it merely uncommitted."""
    _good.pop(uri, None)
    remove(join(uri, COMMIT))
    remove(uri)


def latest_checkpoint(root_uri: str) -> Checkpoint | None:
    """The newest committed checkpoint whose files verify, or None; logs each one it skips."""
    for step, uri in reversed(_steps(root_uri)):
        try:
            return _verify(uri, step)
        except CheckpointInvalid as e:
            log.warning("ignoring %s; the next save removes it", e)
    return None


def newest_commit(root_uri: str) -> tuple[int, dict[str, Any]] | None:
    """The newest step with a COMMIT marker and its ``state.json`` (``{}`` if unreadable), read
    without hashing anything: a light progress probe (what a job trusts is ``latest_checkpoint``)."""
    for step, uri in reversed(_steps(root_uri)):
        if COMMIT in listdir(uri):
            try:
                state = parse_json(get_bytes(join(uri, STATE)))
            except (FileNotFoundError, ValueError):
                state = {}
            return step, state if isinstance(state, dict) else {}
    return None


def load_checkpoint(ckpt: Checkpoint | str) -> Loaded:
    """Parameters, optimizer state and state.json of a checkpoint (or a step directory URI).

    The bytes are verified against COMMIT; an invalid directory raises ``CheckpointInvalid``.
    """
    from safetensors.numpy import load

    if isinstance(ckpt, str):
        uri = ckpt.rstrip("/")
        m = _STEP.fullmatch(basename(uri))
        if not m:
            raise CheckpointInvalid(uri, "not a ckpt/step-<n> directory")
        ckpt = _verify(uri, int(m[1]))
    blobs = dict(ckpt._blobs) or _verify(ckpt.uri, ckpt.step)._blobs
    ckpt._blobs.clear()  # the verified bytes serve one load; later loads read the store again
    try:
        params, opt = load(blobs[PARAMS]), load(blobs[OPT])
    except Exception as e:  # safetensors raises its own error types
        raise CheckpointInvalid(ckpt.uri, f"unreadable safetensors ({e})") from None
    for name, a in {**params, **opt}.items():
        if a.dtype != np.float32:
            raise CheckpointInvalid(ckpt.uri, f"tensor {name!r} is {a.dtype}, not float32")
    state = json.loads(blobs[STATE])
    return Loaded(dict(sorted(params.items())), dict(sorted(opt.items())), state)


def save_checkpoint(
    root_uri: str,
    step: int,
    params: Mapping[str, np.ndarray],
    opt: Mapping[str, np.ndarray],
    state: Mapping[str, Any],
    *,
    keep: int = KEEP,
) -> str:
    """Write ``ckpt/step-<step>/`` under ``root_uri`` and return its URI.

    ``state`` is the state.json document without ``schema_version`` (added here); its ``step``,
    if present, must equal ``step``. Non-finite losses must be given as None. Removes uncommitted
    or damaged directories first and, once COMMIT has landed, committed ones older than the
    ``keep`` newest.
    """
    if step < 0 or keep < 1:
        raise ValueError(f"step {step} and keep {keep}: need step >= 0 and keep >= 1")
    _check_opt(params, opt)
    doc = {"schema_version": SCHEMA_VERSION, **state}
    if doc.setdefault("step", step) != step:
        raise ValueError(f"state says step {doc['step']}, saving step {step}")
    target = step_dir(root_uri, step)
    validate(doc, "checkpoint-state", where=join(target, STATE))
    blobs = {PARAMS: _encode_tensors(params, "parameter"), OPT: _encode_tensors(opt, "optimizer")}
    blobs[STATE] = _dump(doc)
    commit = {
        "schema_version": SCHEMA_VERSION,
        "kind": "spill-checkpoint",
        "step": step,
        "files": {n: {"size": len(blobs[n]), "sha256": _sha256(blobs[n])} for n in FILES},
    }
    validate(commit, "commit", where=join(target, COMMIT))
    commit_bytes = _dump(commit)

    others = []
    for n, uri in _steps(root_uri):
        if n == step:
            continue
        if _committed(uri, n):
            others.append(n)
        else:
            _discard(uri)

    # the exact same checkpoint may already be committed (a stop right after a resume)
    if not _same_commit(target, commit_bytes):
        _discard(target)
        put_bytes(join(target, PARAMS), blobs[PARAMS])
        drill.at(drill.CKPT_BETWEEN_FILES)
        put_bytes(join(target, OPT), blobs[OPT])
        put_bytes(join(target, STATE), blobs[STATE])
        drill.at(drill.CKPT_BEFORE_COMMIT)
        put_bytes(join(target, COMMIT), commit_bytes)
        _good[target] = _sha256(commit_bytes)
    drill.at(drill.CKPT_AFTER_COMMIT)

    older = sorted(n for n in others if n < step)
    for n in older[: max(0, len(older) - (keep - 1))]:
        _discard(step_dir(root_uri, n))
    return target


def _same_commit(uri: str, commit_bytes: bytes) -> bool:
    try:
        if get_bytes(join(uri, COMMIT)) != commit_bytes:
            return False
    except FileNotFoundError:
        return False
    try:
        _verify(uri, json.loads(commit_bytes)["step"])
    except CheckpointInvalid:
        return False
    return True
