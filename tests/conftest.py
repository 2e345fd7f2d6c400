"""Shared fixtures: tiny models of each family, an isolated SPILL_HOME, and a real S3 server.

The S3 server is moto's HTTP server on loopback, reached through s3fs like any S3-compatible
store (``AWS_ENDPOINT_URL``); nothing in-process is mocked.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from spill.models.tiny import write_tiny


@pytest.fixture(autouse=True)
def spill_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("spill-home")
    monkeypatch.setenv("SPILL_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """One tiny random model per family (4 layers, hidden 64), shared by the whole session."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: write_tiny(root / f, family=f, seed=7) for f in ("llama", "qwen2")}


@pytest.fixture(params=["llama", "qwen2"])
def tiny_model(request, tiny_models) -> Path:
    return tiny_models[request.param]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on loopback for the session; yields its endpoint URL."""
    pytest.importorskip("moto.server", reason="moto[server] is in the test extra")
    pytest.importorskip("s3fs", reason="s3fs[boto3] is in the test extra")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("moto server did not start")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch) -> str:
    """A fresh bucket on the test server, with the standard AWS variables pointing at it."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    name = f"spill-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    return name


def run_spill(
    *args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "spill", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )
