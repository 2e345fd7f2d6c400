"""Download a model from the Hugging Face hub at a revision into ``SPILL_HOME/models/hub``.

The folder uses the hub client's own cache layout (``models--<org>--<name>/snapshots/<sha>``), so
revisions share blobs, downloads resume, and the client resolves a cached snapshot with no network.
A commit SHA is looked up in the cache first: a pinned alias that is already here costs no request.
``HF_HUB_OFFLINE`` is read at call time (the client reads it once, at import). The first time a
snapshot is seen its files are recorded: for LFS files the sha256 the hub reported (the client
names each blob by it, so no request is needed), the small git files hashed here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path

from spill.errors import ModelNotFound
from spill.ground.paths import models_dir
from spill.models.cache import MODEL_FILES, is_model_file, read_marker, write_marker
from spill.models.integrity import record

_SHA = re.compile(r"^[0-9a-f]{40}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def hub_cache() -> Path:
    return models_dir() / "hub"


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _not_cached(model_id: str, revision: str, why: str) -> ModelNotFound:
    online = "go online (unset HF_HUB_OFFLINE)" if offline() else "go online"
    return ModelNotFound(
        f"{model_id}@{revision[:12]} is not cached here ({why}); use --weights <uri>, a local model "
        f"folder, `spill models import`, or {online}"
    )


def _kwargs(revision: str) -> dict:
    return dict(revision=revision, cache_dir=hub_cache(), allow_patterns=list(MODEL_FILES))


def hub_hashes(folder: Path) -> dict[str, str]:
    """name -> the sha256 the hub reported for each LFS file of a snapshot: the client stores an
    LFS file as a blob named by its sha256 (the hub's ETag) and links the snapshot entry to it."""
    out = {}
    for path in Path(folder).iterdir():
        if is_model_file(path.name) and path.is_symlink():
            blob = os.path.basename(os.readlink(path))
            if _SHA256.match(blob):
                out[path.name] = blob
    return out


def _mark(folder: Path, model_id: str) -> Path:
    fields = dict(
        source="hub",
        name=f"{model_id}@{folder.name[:12]}",
        model_id=model_id,
        revision=folder.name,  # a snapshot folder is named by its commit
    )
    try:
        if read_marker(folder).get("files"):
            write_marker(folder, **fields)
        else:  # first sight of this snapshot: the hub's LFS hashes, the small files hashed here
            record(folder, known=hub_hashes(folder), **fields)
    except OSError:
        pass  # a read-only cache still serves; it is listed without a name, used without records
    return folder


def cached(model_id: str, revision: str = "main") -> Path | None:
    """The complete cached snapshot of ``model_id`` at ``revision``, or None; never asks the hub."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        path = snapshot_download(model_id, local_files_only=True, **_kwargs(revision))
    except (LocalEntryNotFoundError, IncompleteSnapshotError):
        return None
    return _mark(Path(path), model_id)


def download(
    model_id: str, revision: str = "main", *, progress: Callable[[str], object] = print
) -> Path:
    """The snapshot folder of ``model_id`` at ``revision``, downloading what is missing."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if offline() or _SHA.match(revision):  # a commit never changes: the cache answers for it
        folder = cached(model_id, revision)
        if folder is not None:
            return folder
        if offline():
            raise _not_cached(model_id, revision, "HF_HUB_OFFLINE is set")
    why = unreachable()
    if why:
        raise _not_cached(model_id, revision, why)
    progress(f"fetching {model_id}@{revision[:12]} from the Hugging Face hub into {hub_cache()}")
    try:
        path = snapshot_download(model_id, **_kwargs(revision))
    except GatedRepoError:
        raise ModelNotFound(
            f"{model_id} is gated on the hub; accept its license on huggingface.co, then run "
            "`hf auth login` (or set HF_TOKEN)"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"{model_id} has no revision {revision!r} on the hub") from None
    except RepositoryNotFoundError:
        raise ModelNotFound(
            f"{model_id}: no such model on the hub (or it is private: `hf auth login`)"
        ) from None
    except (LocalEntryNotFoundError, IncompleteSnapshotError):
        raise _not_cached(model_id, revision, "the hub cannot be reached") from None
    except (HfHubHTTPError, OSError) as e:
        raise _not_cached(model_id, revision, f"{type(e).__name__}: {e}") from None
    return _mark(Path(path), model_id)


def unreachable(timeout: float = 5.0) -> str:
    """Why the hub (``HF_ENDPOINT``, or the proxy that reaches it) cannot be reached now, or
    ``""``: one TCP connect, so that a machine without a network fails in milliseconds, not
    after the hub client's ~24 s of retries."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    endpoint = os.environ.get("HF_ENDPOINT") or constants.ENDPOINT
    proxy = next(
        (
            os.environ[k]
            for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")
            if os.environ.get(k)
        ),
        None,
    )
    url = urlsplit(proxy if proxy and "://" in proxy else f"http://{proxy}" if proxy else endpoint)
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        what = "its proxy " if proxy else ""
        return (
            f"the hub cannot be reached: {what}{host}:{port}: {e.strerror or e}; set "
            "HF_HUB_OFFLINE=1 to use only what is cached"
        )
    return ""


def reported_files(model_id: str, revision: str, timeout: float = 20) -> dict[str, dict]:
    """What the hub says the model files of ``model_id`` at commit ``revision`` are: name ->
    size, sha256 (LFS files) and git blob id (every file). Raises ``ModelNotFound`` (why, one
    line) when the hub cannot be asked: offline, unreachable, or no such commit."""
    if offline():
        raise ModelNotFound("HF_HUB_OFFLINE is set, so the hub cannot be asked")
    why = unreachable()
    if why:
        raise ModelNotFound(why)
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    try:
        info = HfApi().model_info(model_id, revision=revision, files_metadata=True, timeout=timeout)
    except (HfHubHTTPError, OSError, ValueError) as e:
        raise ModelNotFound(
            f"the hub did not answer for {model_id}@{revision[:12]} ({e})"
        ) from None
    except Exception as e:  # requests' and httpx's connection errors alike
        raise ModelNotFound(f"the hub cannot be reached ({type(e).__name__})") from None
    if info.sha and info.sha != revision:
        raise ModelNotFound(f"the hub answered for commit {info.sha[:12]}, not {revision[:12]}")
    out = {}
    for s in info.siblings or []:
        if "/" not in s.rfilename and is_model_file(s.rfilename):
            lfs = s.lfs.sha256 if s.lfs is not None else None
            out[s.rfilename] = {"size": s.size, "sha256": lfs, "oid": s.blob_id}
    return out


def git_blob_id(data: bytes) -> str:
    """The id git (and the hub) gives a file of these bytes: sha1 of ``blob <size>\\0<bytes>``."""
    import hashlib

    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
