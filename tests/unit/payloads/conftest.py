"""Payload fixtures: a state root on each backend, the worker's test data, and a worker runner."""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("payload_worker.py")
_worker = runpy.run_path(str(WORKER))


@pytest.fixture
def data():
    """``data(step) -> (params, opt, state)``, the same content the worker saves."""
    return _worker["tensors"]


@pytest.fixture
def identity() -> dict:
    return _worker["IDENTITY"]


@pytest.fixture
def producer() -> dict:
    return _worker["PRODUCER"]


@pytest.fixture
def run_worker():
    """Run the worker in a real process with ``SPILL_DRILL`` set; returns the CompletedProcess."""

    def run(*args: str, drill: str | None = None) -> subprocess.CompletedProcess:
        env = dict(os.environ)
        env.pop("SPILL_DRILL", None)
        if drill:
            env["SPILL_DRILL"] = drill
        return subprocess.run(
            [sys.executable, str(WORKER), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    return run
