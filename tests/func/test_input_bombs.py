"""Memory and time bombs in inputs, templates and chat, through the real CLI (issue 35 items 8,
9, 12, 13, 23). Each test makes its hostile input itself and checks the exit code, the one
line on stderr, no traceback, and the child's peak RSS (its own ``wait4`` rusage) and time
against generous bounds far below what the bomb took before (a 25 PB plan, memory without
bound, hours).

* a row longer than the model's context keeps its last tokens (one note names it) and the job
  finishes; ``--max-new-tokens`` that leaves no room is refused;
* ``spill chat``: a line over 1 MiB or not UTF-8 ends the chat in one line, a message that
  would pass the context is refused and the chat goes on;
* ``prompt.template`` with a format spec is refused at compose;
* a model whose chat template multiplies, loops or pads without bound fails in one line;
* JSONL nested 100,000 deep, a lone surrogate, binary bytes: one line naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ENV = {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
ROOT = Path(__file__).resolve().parents[2]
RSS_MB = 1500  # the tiny model's jobs peak near 330 MB here; each bomb took GBs, then more
SECONDS = 120  # generous: each finishes in a few seconds here


@dataclass
class Ran:
    code: int
    out: str
    err: str
    rss_mb: float
    seconds: float

    def one_line(self) -> str:
        lines = [x for x in self.err.splitlines() if x.startswith("spill: error: ")]
        assert len(lines) == 1 and "Traceback" not in self.err, self.err
        return lines[0]


def measured(*args: str, home: Path, stdin: Path | None = None, cwd: Path | None = None) -> Ran:
    """``spill ARGS`` in a child whose own peak RSS comes back from ``wait4``; killed after
    ``SECONDS``."""
    env = {**os.environ, **ENV, "SPILL_HOME": str(home)}
    out, err = cwd_file(home, "out"), cwd_file(home, "err")
    with open(stdin or os.devnull, "rb") as i, open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spill", *args], stdin=i, stdout=o, stderr=e, env=env, cwd=cwd
        )
        timer = threading.Timer(SECONDS, proc.kill)
        timer.start()
        start = time.monotonic()
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.monotonic() - start
        timer.cancel()
        proc.returncode = code = os.waitstatus_to_exitcode(status)
    kb = usage.ru_maxrss / (1024 if sys.platform == "darwin" else 1)
    ran = Ran(
        code, out.read_text(errors="replace"), err.read_text(errors="replace"), kb / 1024, seconds
    )
    assert ran.seconds < SECONDS and ran.rss_mb < RSS_MB, (ran.seconds, ran.rss_mb, ran.err)
    return ran


def cwd_file(home: Path, name: str) -> Path:
    home.mkdir(parents=True, exist_ok=True)
    return home / f"{name}-{time.monotonic_ns()}.txt"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from spill.models.sources.tiny import write_tiny

    return write_tiny(tmp_path_factory.mktemp("bombs") / "model", family="qwen2", seed=11)


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# --- item 8: a row longer than the model's context --------------------------------------------


def test_a_row_longer_than_the_context_keeps_its_tail_and_the_job_finishes(model, tmp_path):
    rows = [{"id": "short", "prompt": "hello"}, {"id": "huge", "prompt": "word " * 2_000_000}]
    src, out = _jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "out.jsonl"
    for chat in ([], ["--chat"]):
        ran = measured(
            "run", str(model), str(src), "--out", str(out), "--max-new-tokens", "4",
            "--dtype", "float32", *chat, home=tmp_path / "home",
        )  # fmt: skip
        assert ran.code == 0 and "Traceback" not in ran.err, ran.err
        assert "1 row(s) longer than the model's context (2048 tokens, 4 of them new)" in ran.err
        assert "keep their last 2044 prompt tokens: 'huge'" in ran.err
        got = [json.loads(x) for x in out.read_text().splitlines()]
        assert [r["id"] for r in got] == ["short", "huge"] and got[1]["tokens"] == 4


def test_max_new_tokens_that_leave_no_room_are_refused(model, tmp_path):
    src, out = _jsonl(tmp_path / "rows.jsonl", [{"prompt": "hello"}]), tmp_path / "out.jsonl"
    ran = measured(
        "run", str(model), str(src), "--out", str(out), "--max-new-tokens", "2048",
        home=tmp_path / "home",
    )  # fmt: skip
    assert ran.code == 1 and not out.exists()
    assert "2048 new tokens" in ran.one_line() and "context of 2048 tokens" in ran.one_line()


# --- item 9 and 23: spill chat's input ---------------------------------------------------------


def test_chat_refuses_a_5_mb_line_in_one_line(model, tmp_path):
    (lines := tmp_path / "in.txt").write_text("hello\n" + "word " * 1_000_000 + "\nmore\n")
    ran = measured("chat", str(model), "--max-new-tokens", "4", home=tmp_path / "h", stdin=lines)
    assert ran.code == 1
    assert "stdin: line 2 is longer than 1 MiB" in ran.one_line()


def test_chat_refuses_a_message_past_the_context_and_goes_on(model, tmp_path):
    (lines := tmp_path / "in.txt").write_text("word " * 150_000 + "\nhello\n")
    ran = measured("chat", str(model), "--max-new-tokens", "4", home=tmp_path / "h", stdin=lines)
    assert ran.code == 1  # a script sees that a turn was refused
    assert "past the 2044 tokens the model's context (2048) leaves" in ran.one_line()
    # the first turn refused, the second answered, then the prompt at the end of input
    assert ran.out.startswith("> > ") and ran.out.endswith("\n> \n")


def test_chat_refuses_binary_stdin_in_one_line(model, tmp_path):
    (lines := tmp_path / "in.bin").write_bytes(bytes(range(256)) * 64)
    ran = measured("chat", str(model), "--max-new-tokens", "4", home=tmp_path / "h", stdin=lines)
    assert ran.code == 1 and "is not UTF-8 text" in ran.one_line()


# --- item 13: a model's chat template --------------------------------------------------------

BOMBS = {
    "repeat": "{{ 'a' * 40000000000 }}",
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}",
    "padding": "{{ messages[0]['content']|center(10000000000) }}",
}


@pytest.mark.parametrize("bomb", sorted(BOMBS))
def test_a_chat_template_bomb_is_one_line(model, tmp_path, bomb):
    from spill.models.cache import MARKER
    from spill.models.integrity import record

    hostile = tmp_path / "model"
    shutil.copytree(model, hostile)
    (hostile / "chat_template.jinja").write_text(BOMBS[bomb])
    (hostile / MARKER).unlink()  # recorded again: the template is part of the model as it came
    record(hostile, stat_cache=False, source="tiny", family="qwen2", seed=11)
    src, out = _jsonl(tmp_path / "rows.jsonl", [{"prompt": "a"}, {"prompt": "b"}]), tmp_path / "o"
    ran = measured(
        "run", str(hostile), str(src), "--out", str(out), "--chat", home=tmp_path / "home"
    )
    assert ran.code == 1 and not out.exists()
    assert f"{hostile}: chat template failed: " in ran.one_line()


# --- item 12: prompt.template ----------------------------------------------------------------


def test_a_padding_prompt_template_is_refused_before_anything_runs(tmp_path):
    project = tmp_path / "toy"
    shutil.copytree(ROOT / "projects" / "toy", project, ignore=shutil.ignore_patterns(".spill"))
    with open(project / "spill.yaml", "a") as f:  # the toy project sets no prompt section
        f.write("prompt:\n  template: '{input} {input:>300000000}'\n")
    ran = measured("build", str(project), home=tmp_path / "home")
    assert ran.code == 1 and not (project / ".spill").exists()
    assert "prompt.template has {input:>300000000}; write {input} alone" in ran.one_line()


# --- item 23: JSONL that the parser or the tokenizer cannot take ---------------------------------

JSONL = {
    "deep": (b"[" * 100_000 + b"]" * 100_000 + b"\n", ":1: JSON nested too deeply to read"),
    "surrogate": (
        b'{"prompt": "a"}\n{"prompt": "x\\ud800y"}\n',
        ":2: a string holds a lone surrogate escape",
    ),
    "binary": (b'{"prompt": "a"}\n' + bytes(range(128, 256)) + b"\n", ":2: not UTF-8 text"),
}


@pytest.mark.parametrize("case", sorted(JSONL))
def test_jsonl_the_parser_cannot_take_is_one_line_naming_the_file(model, tmp_path, case):
    data, words = JSONL[case]
    (src := tmp_path / "rows.jsonl").write_bytes(data)
    out = tmp_path / "out.jsonl"
    ran = measured("run", str(model), str(src), "--out", str(out), home=tmp_path / "home")
    assert ran.code == 1 and not out.exists()
    assert f"{src}{words}" in ran.one_line()
    assert src.read_bytes() == data  # the input is left as it was
