"""``spill chat`` in a real terminal: a pty whose child is the CLI, typed at through the master.

The terminal keeps its line discipline (Ctrl-D is end of input, Ctrl-C is SIGINT to the
child) with echo and output translation off, so what is read back is exactly what spill wrote.
Every reply is checked against ``spill run --chat``-style greedy generation of the same
conversation (``spill run`` on ``messages`` rows), so the streamed text is the model's reply.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import sys
import termios
import time
from pathlib import Path

import pytest

from tests.conftest import run_spill

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
NEW = 24  # tokens a reply may have


class Terminal:
    """``spill chat`` on a pty; ``read_until`` collects output up to a marker."""

    def __init__(self, *args: str, env: dict) -> None:
        pid, fd = pty.fork()
        if pid == 0:  # the child: the pty is its controlling terminal
            attrs = termios.tcgetattr(0)
            attrs[1] &= ~termios.OPOST  # no \n -> \r\n
            attrs[3] &= ~(termios.ECHO | termios.ECHONL)
            termios.tcsetattr(0, termios.TCSANOW, attrs)
            os.execvpe(sys.executable, [sys.executable, "-m", "spill", "chat", *args], env)
        self.pid, self.fd, self.buffer = pid, fd, b""

    def read_until(self, marker: bytes, timeout: float = 60) -> bytes:
        deadline = time.monotonic() + timeout
        while marker not in self.buffer:
            left = deadline - time.monotonic()
            assert left > 0, f"no {marker!r} in {self.buffer!r}"
            if select.select([self.fd], [], [], left)[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the child closed the terminal
                    chunk = b""
                assert chunk, f"the terminal closed before {marker!r}: {self.buffer!r}"
                self.buffer += chunk
        got, _, self.buffer = self.buffer.partition(marker)
        return got

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def state(self) -> str:
        with open(f"/proc/{self.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def wait(self) -> int:
        _, status = os.waitpid(self.pid, 0)
        os.close(self.fd)
        return os.waitstatus_to_exitcode(status)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict:
    from spill.models.sources.tiny import write_tiny

    root = tmp_path_factory.mktemp("chat")
    folder = write_tiny(root / "model", family="qwen2", seed=11)
    return {"folder": str(folder), "env": {**os.environ, **ENV, "SPILL_HOME": str(root)}}


def greedy(model: dict, tmp_path: Path, conversations: list[list[dict]]) -> list[str]:
    """``spill run``'s greedy reply to each conversation (the chat template, ``messages``)."""
    src, out = tmp_path / "conv.jsonl", tmp_path / "replies.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    args = ["run", model["folder"], str(src), "--out", str(out), "--max-new-tokens", str(NEW)]
    proc = run_spill(*args, "--dtype", "float32", env=model["env"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line)["output"] for line in out.read_text().splitlines()]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_chat_streams_replies_keeps_the_conversation_resets_and_leaves(model, tmp_path):
    term = Terminal(
        model["folder"], "--max-new-tokens", str(NEW), "--dtype", "float32", env=model["env"]
    )
    term.read_until(b"> ")  # the prompt
    term.type("hello there\n")
    first = term.read_until(b"\n> ").decode()
    term.type("and then?\n")
    second = term.read_until(b"\n> ").decode()
    term.type("/reset\n")
    assert term.read_until(b"\n> ") == b"(conversation cleared)"
    term.type("hello there\n")
    third = term.read_until(b"\n> ").decode()
    term.type("\x04")  # Ctrl-D at an empty line: end of input
    assert term.read_until(b"\n", timeout=30) == b""
    assert term.wait() == 0

    a, b = greedy(
        model,
        tmp_path,
        [
            [user("hello there")],
            [user("hello there"), {"role": "assistant", "content": first}, user("and then?")],
        ],
    )
    assert first == a and first  # the reply is the model's greedy chat reply
    assert second == b  # the second turn saw the first: the conversation accumulates
    assert third == first  # after /reset the conversation starts again


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(model, tmp_path):
    """The drill pauses the process after the third token is shown; Ctrl-C typed then (a real
    SIGINT from the terminal) ends that reply there."""
    env = {**model["env"], "SPILL_DRILL": "chat-token@3:stop"}
    term = Terminal(model["folder"], "--max-new-tokens", str(NEW), "--dtype", "float32", env=env)
    term.read_until(b"> ")
    term.type("hello there\n")
    deadline = time.monotonic() + 60
    while term.state() != "T":
        assert time.monotonic() < deadline, "the drill never paused the chat"
        time.sleep(0.01)
    term.type("\x03")  # Ctrl-C: the terminal sends SIGINT to the paused process
    time.sleep(0.2)
    os.kill(term.pid, signal.SIGCONT)
    cut = term.read_until(b"\n> ").decode()
    assert cut.endswith(" [stopped]")
    (full,) = greedy(model, tmp_path, [[user("hello there")]])
    shown = cut.removesuffix(" [stopped]")
    assert shown and full.startswith(shown) and len(shown) < len(full)
    term.type("/reset\n")
    assert term.read_until(b"\n> ") == b"(conversation cleared)"
    term.type("\x04")
    term.read_until(b"\n", timeout=30)
    assert term.wait() == 0


def test_chat_help_and_a_model_without_chat_template(model, tmp_path):
    proc = run_spill("chat", "--help", env=model["env"])
    assert proc.returncode == 0 and "/reset" in proc.stdout and "--adapter" in proc.stdout
    import shutil

    plain = tmp_path / "plain"
    shutil.copytree(model["folder"], plain)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    (plain / "spill-source.json").unlink()  # its file records: this folder is a new model
    proc = run_spill("chat", str(plain), env=model["env"], timeout=120)
    assert proc.returncode == 1
    assert "has no chat template; spill chat needs a chat model" in proc.stderr
