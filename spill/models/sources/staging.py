"""Stage a model folder from shared storage (``--weights <uri>``) onto local disk through fsspec
(``stage``). Any fsspec URI works: a local path, ``memory://``, ``s3://`` (endpoint and credentials
come the standard way, ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, profiles), ``gs://`` and
``az://`` with the cloud extra. Only model files are copied. The destination is a mirror: a file
whose size already matches is skipped (so a second stage copies nothing), and model files the source
no longer has are removed (a stale shard would otherwise be picked up). Each file's sha256 is
recorded in the folder's marker.
"""

from __future__ import annotations

import os
import posixpath
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from spill.errors import ModelNotFound, StoreError
from spill.models.cache import is_model_file, read_marker
from spill.models.integrity import CHUNK, hash_now, record, stat_key
from spill.models.scan import NotFinite, Scan, not_finite


@dataclass(frozen=True)
class StageReport:
    bytes_copied: int
    files_copied: int
    files_skipped: int
    seconds: float


def _open_fs(uri: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(uri)
    except ImportError as e:
        raise StoreError(
            f"{uri}: no fsspec driver for this scheme ({e}); pip install 'streamweights[cloud]'"
        ) from None
    except ValueError as e:
        raise StoreError(f"{uri}: not a storage URI fsspec understands ({e})") from None


def _list_model_files(fs, root: str, uri: str) -> dict[str, tuple[str, int]]:
    """Model file name -> (remote path, size) for the files directly in ``root``."""
    fs.invalidate_cache(root)  # s3fs keeps listings; a re-stage must see the remote as it is now
    try:
        infos = fs.ls(root, detail=True)
    except FileNotFoundError:
        raise ModelNotFound(
            f"{uri}: no such folder; --weights must point at an HF-layout model folder"
        ) from None
    except Exception as e:  # any store's own error type: credentials, endpoint, permissions
        raise StoreError(
            f"{uri}: cannot list ({type(e).__name__}: {e}); check the URI, AWS_ENDPOINT_URL and credentials"
        ) from None
    files = {}
    for info in infos:
        name = posixpath.basename(info["name"].rstrip("/"))
        if info.get("type") == "file" and is_model_file(name):
            files[name] = (info["name"], int(info.get("size") or 0))
    if "config.json" not in files:
        raise ModelNotFound(
            f"{uri}: no config.json there; --weights must point at an HF-layout model folder"
        )
    if not any(n.endswith(".safetensors") for n in files):
        raise ModelNotFound(
            f"{uri}: no *.safetensors files there; --weights must point at an HF-layout model folder"
        )
    return files


# Each copy lands under a temp name and is renamed into place (a killed copy never leaves a short
# shard under the real name); the sha256 is computed while it is copied.
def _copy(fs, remote: str, local: Path) -> str:
    """Copy ``remote`` to ``local`` and return its sha256, hashed (and a safetensors file's
    float tensors checked for NaN and inf, ``NotFinite``) while copying."""
    scan = Scan(remote.endswith(".safetensors"))
    with fs.open(remote, "rb") as src, open(local, "wb") as dst:
        while chunk := src.read(CHUNK):
            scan.update(chunk)
            dst.write(chunk)
        dst.flush()
        os.fsync(dst.fileno())
    if scan.bad is not None:
        raise NotFinite(f"{not_finite(remote, scan.bad)}: repair it there, then stage it again")
    return scan.hexdigest()


# A kept file is hashed unless its stat still matches the last verified one.
def _local_hash(
    path: Path, rec: dict | None, key: list[int] | None
) -> tuple[str, list[int] | None]:
    """A kept file's sha256: its record while its stat is the one verified last, else hashed."""
    if rec is not None and key is not None and key == stat_key(path) and rec["size"] == key[0]:
        return rec["sha256"], key
    return hash_now(path)


def stage(uri: str, dest: Path, progress: Callable[[str], object] = print) -> StageReport:
    """Copy the model folder at ``uri`` into ``dest``, skipping files whose size already matches."""
    start = time.perf_counter()
    dest = Path(dest)
    fs, root = _open_fs(uri)
    files = _list_model_files(fs, root.rstrip("/") or root, uri)
    dest.mkdir(parents=True, exist_ok=True)
    marker = read_marker(dest)  # an invalid record is refused here, never copied over
    old, verified = marker.get("files") or {}, marker.get("verified") or {}
    hashed: dict[str, tuple[str, list[int] | None]] = {}
    copied = skipped = nbytes = 0
    for name, (remote, size) in sorted(files.items()):
        target = dest / name
        if target.is_file() and target.stat().st_size == size:
            hashed[name] = _local_hash(target, old.get(name), verified.get(name))
            skipped += 1
            continue
        tmp = dest / f".{name}.{os.getpid()}.partial"
        try:
            digest = _copy(fs, remote, tmp)
            got = tmp.stat().st_size
            if got != size:
                raise StoreError(
                    f"{uri}/{name}: copied {got} bytes, the store lists {size}; the source changed while staging, run again"
                )
            os.replace(tmp, target)
            hashed[name] = (digest, stat_key(target))
        except (StoreError, NotFinite):
            raise
        except Exception as e:
            raise StoreError(f"{uri}/{name}: copy failed ({type(e).__name__}: {e})") from None
        finally:
            tmp.unlink(missing_ok=True)
        copied += 1
        nbytes += size
    for stale in dest.iterdir():
        if stale.is_file() and is_model_file(stale.name) and stale.name not in files:
            stale.unlink()
    record(dest, hashed=hashed, source="staged", uri=uri)
    seconds = time.perf_counter() - start
    progress(f"staged {copied} files, {nbytes / 1e6:.1f} MB in {seconds:.1f} s ({skipped} skipped)")
    return StageReport(
        bytes_copied=nbytes, files_copied=copied, files_skipped=skipped, seconds=seconds
    )
