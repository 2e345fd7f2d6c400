"""Real servers on loopback for the tests and the benchmarks: moto's S3 server over HTTP.

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
