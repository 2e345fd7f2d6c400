"""Tune checkpoints: payload folders ``<job>/payloads/ckpt-g<gen>-s<step>-<attempt>/`` with
``params.safetensors``, ``opt.safetensors``, ``state.json`` (schema ``checkpoint-state``) and,
written last, ``COMMIT`` (schema ``commit``: size and sha256 of the three). ``save_checkpoint``
writes a new folder and publishes it on the run's ``ckpt`` pointer; ``latest_checkpoint`` follows
the pointer (never "the highest step folder") and skips a folder that fails verification;
``load_checkpoint`` reads it; ``settle`` waits for the removal of old folders. Recovery and removal:
docs/design.md, "Payloads".
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from spill.control.place import Place, payload_seq
from spill.errors import StoreError
from spill.ground.hashing import buffers_sha256
from spill.ground.validate import SchemaInvalid, parse_json, validate
from spill.payloads.newest import COMMIT, KIND, STATE
from spill.payloads.newest import newest_commit as newest_commit  # its old home
from spill.store import drill
from spill.store.fs import get_bytes, join, put_bytes, put_fresh, sync_fresh
from spill.store.safetensors_io import encode

PARAMS = "params.safetensors"
OPT = "opt.safetensors"
FILES = (PARAMS, OPT, STATE)
KEEP = 2
SCHEMA_VERSION = 1

log = logging.getLogger(__name__)

_good: dict[str, str] = {}  # step directory URI -> sha256 of a COMMIT verified in this process
_removing: dict[str, threading.Thread] = {}  # place URI -> its older folders being removed


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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _dump(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, indent=1, allow_nan=False).encode() + b"\n"


# Tensors are float32 in ``safetensors.numpy.save``'s layout (``safetensors_io.encode``), so equal
# inputs give equal bytes; optimizer tensors are ``m::<name>`` and ``v::<name>`` (and
# ``best::<name>``, the best adapter so far of a run that keeps it: ``spill.jobs.tune.validation``).
def _encode_tensors(tensors: Mapping[str, np.ndarray], what: str) -> list[bytes | memoryview]:
    for name, a in tensors.items():
        if not isinstance(a, np.ndarray) or a.dtype != np.float32:
            kind = a.dtype if isinstance(a, np.ndarray) else type(a).__name__
            raise ValueError(
                f"{what} tensor {name!r} is {kind}; checkpoints hold float32 numpy arrays"
            )
    return encode({k: ("F32", a) for k, a in tensors.items()})


def _check_opt(params: Mapping[str, np.ndarray], opt: Mapping[str, np.ndarray]) -> None:
    for key, a in opt.items():
        kind, _, name = key.partition("::")
        if kind not in ("m", "v", "best") or name not in params:
            raise ValueError(
                f"optimizer tensor {key!r} is not m::<param>, v::<param> or best::<param>"
            )
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


def latest_checkpoint(place: Place) -> Checkpoint | None:
    """The newest checkpoint the run points at whose files verify, or None; logs each one it
    skips."""
    for uri in place.pointer(KIND):
        try:
            return _verify(uri, payload_seq(uri))
        except CheckpointInvalid as e:
            log.warning("ignoring %s", e)
    return None


def load_checkpoint(ckpt: Checkpoint | str) -> Loaded:
    """Parameters, optimizer state and state.json of a checkpoint (or a step directory URI).

    The bytes are verified against COMMIT; an invalid directory raises ``CheckpointInvalid``.
    """
    from safetensors.numpy import load

    if isinstance(ckpt, str):
        uri = ckpt.rstrip("/")
        if (step := payload_seq(uri)) is None:
            raise CheckpointInvalid(uri, "not a payloads/ckpt-g<gen>-s<step>-<n> folder")
        ckpt = _verify(uri, step)
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
    place: Place,
    step: int,
    params: Mapping[str, np.ndarray],
    opt: Mapping[str, np.ndarray],
    state: Mapping[str, Any],
    *,
    keep: int = KEEP,
) -> str:
    """Write a checkpoint payload for ``step``, make it current, and return its URI.

    ``state`` is the state.json document without ``schema_version`` (added here); its ``step``,
    if present, must equal ``step``. Non-finite losses must be given as None. Once it is
    published, the ``keep`` newest pointed checkpoints stay and other folders of its kind go.

    The tensors' own memory is written (no encoded copy) while it is hashed; the three files are
    fsynced, then COMMIT goes in atomically and the pointer moves.
    """
    if step < 0 or keep < 1:
        raise ValueError(f"step {step} and keep {keep}: need step >= 0 and keep >= 1")
    _check_opt(params, opt)
    settle(place)  # a removal still running must not see this save's new folder
    doc = {"schema_version": SCHEMA_VERSION, **state}
    if doc.setdefault("step", step) != step:
        raise ValueError(f"state says step {doc['step']}, saving step {step}")
    validate(doc, "checkpoint-state", where=join(place.uri, f"payloads/{KIND}-s{step}", STATE))
    with ThreadPoolExecutor(2, thread_name_prefix="spill-ckpt") as pool:
        # two cores' worth of work: one thread hashes the largest file from the start; this one
        # writes the files, hands their fsync (a wait on the disk) to the other thread, then
        # hashes the rest
        parts = {OPT: _encode_tensors(opt, "optimizer")}
        opt_digest = pool.submit(buffers_sha256, parts[OPT])
        parts |= {PARAMS: _encode_tensors(params, "parameter"), STATE: [_dump(doc)]}
        current = place.pointer(KIND)
        # the exact same checkpoint may already be current (a stop right after a resume): then
        # nothing is written before the hashes say whether it is
        again = bool(current) and payload_seq(current[0]) == step
        target = place.payload(KIND, step)
        synced = None if again else pool.submit(sync_fresh, _write_files(target, parts))
        hashed = {n: buffers_sha256(parts[n]) for n in (PARAMS, STATE)}
        hashed[OPT] = opt_digest.result()
        files = {n: {"size": _size(parts[n]), "sha256": hashed[n]} for n in FILES}
        if synced is not None:
            synced.result()
    commit = {"schema_version": SCHEMA_VERSION, "kind": "spill-checkpoint", "step": step}
    commit["files"] = files
    validate(commit, "commit", where=join(place.uri, f"payloads/{KIND}-s{step}", COMMIT))
    commit_bytes = _dump(commit)
    if again:
        if _same_commit(current[0], commit_bytes):
            drill.at(drill.CKPT_AFTER_COMMIT)
            return current[0]
        sync_fresh(_write_files(target, parts))
    drill.at(drill.CKPT_BEFORE_COMMIT)
    put_bytes(join(target, COMMIT), commit_bytes)
    _good[target] = _sha256(commit_bytes)
    # a pointed checkpoint that no longer verifies is dropped, so a good one is not rotated away
    older = [u for u in current if (payload_seq(u) or 0) < step and _committed(u)]
    kept = [target, *older[: keep - 1]]
    place.publish(KIND, kept)
    drill.at(drill.CKPT_AFTER_COMMIT)
    remover = threading.Thread(
        target=_collect, args=(place, set(kept)), name="spill-ckpt-collect", daemon=False
    )
    _removing[place.uri] = remover
    remover.start()
    return target


def settle(place: Place | None = None) -> None:
    """Wait until the older checkpoint folders a save is removing (of ``place``, or of every
    place) are gone."""
    for uri in [place.uri] if place is not None else list(_removing):
        if (remover := _removing.pop(uri, None)) is not None:
            remover.join()


def _collect(place: Place, keep: set[str]) -> None:
    try:
        place.collect(KIND, keep)
    except StoreError as e:  # the next save tries again
        log.warning("older checkpoints not removed yet: %s", e)


def _size(parts: list[bytes | memoryview]) -> int:
    return sum(memoryview(b).nbytes for b in parts)


def _write_files(target: str, parts: Mapping[str, list[bytes | memoryview]]) -> list[str]:
    """Write the three files of a new payload folder in place (nobody reads them before the
    COMMIT that follows names their sizes and hashes) and return their URIs, to be fsynced
    (``sync_fresh``) before that COMMIT."""
    put_fresh(join(target, PARAMS), parts[PARAMS])
    drill.at(drill.CKPT_BETWEEN_FILES)
    put_fresh(join(target, OPT), parts[OPT])
    put_fresh(join(target, STATE), parts[STATE])
    return [join(target, n) for n in FILES]


def _committed(uri: str) -> bool:
    """Whether ``uri`` is a good checkpoint, hashing it only if not yet verified here."""
    try:
        raw = get_bytes(join(uri, COMMIT))
    except FileNotFoundError:
        raw = None
    if raw is not None and _good.get(uri) == _sha256(raw):
        return True
    try:
        _verify(uri, payload_seq(uri))
    except CheckpointInvalid as e:
        log.info("dropping %s", e)
        return False
    return True


def _same_commit(uri: str, commit_bytes: bytes) -> bool:
    try:
        if get_bytes(join(uri, COMMIT)) != commit_bytes:
            return False
    except FileNotFoundError:
        return False
    if _good.get(uri) == _sha256(commit_bytes):
        return True
    try:
        _verify(uri, json.loads(commit_bytes)["step"])
    except CheckpointInvalid:
        return False
    return True
