"""A machine without a network fails fast and says what to do (issue 21, item 5): a model that
is not cached, fetched from a hub nobody answers for, is one line naming the host and
``HF_HUB_OFFLINE``, from one refused connection, not the hub client's ~24 s of retries."""

from __future__ import annotations

import os
import socket
import subprocess
import sys


def test_an_unreachable_hub_is_one_line_naming_hf_hub_offline(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n')
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(SPILL_HOME=str(tmp_path / "home"), HF_ENDPOINT=f"http://127.0.0.1:{port}")
    args = ("run", "qwen2.5:0.5b", str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o"))
    proc = subprocess.run(
        [sys.executable, "-m", "spill", *args], capture_output=True, text=True, env=env, timeout=120
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert f"the hub cannot be reached: 127.0.0.1:{port}: " in lines[0]
    assert "set HF_HUB_OFFLINE=1 to use only what is cached" in lines[0]
