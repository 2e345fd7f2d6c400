"""Hostile GGUF files through the real CLI (``spill models import``), made here byte by byte:
one line on stderr, exit 1, no traceback, nothing written to the cache, bounded memory and time;
an import never lands in an alias's folder; the name an import prints is usable by every verb."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.unit.models.gguf.gguf_bytes import ARRAY, I32, U8, Raw, small_llama, small_metadata

MB = 1 << 20


def spill(*args: str, cwd: Path | None = None) -> tuple[int, str, str, int, float]:
    """(exit code, stdout, stderr, peak RSS in bytes, seconds) of ``spill *args`` in a child
    of its own, so its ``ru_maxrss`` is its own (``os.wait4``)."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-m", "spill", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
    )
    out, err = proc.stdout.read(), proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, out, err, usage.ru_maxrss * 1024, time.perf_counter() - start


def one_line_refusal(rc: int, err: str, path: Path) -> str:
    assert rc == 1 and "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("spill: error: "), err
    assert str(path) in lines[0], lines[0]
    return lines[0]


def nothing_cached(home: Path) -> None:
    models = home / "models"
    left = sorted(p.name for p in models.rglob("*")) if models.exists() else []
    assert left == [], left


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> int:
    """Peak RSS of the same command refusing a file that is not a GGUF at all."""
    path = tmp_path_factory.mktemp("base") / "notes.gguf"
    path.write_text("not a model\n" * 10)
    rc, _, err, rss, _ = spill("models", "import", str(path))
    one_line_refusal(rc, err, path)
    return rss


def _bomb_block_count(path: Path) -> Path:
    """~116 KB: a one-layer model that declares 10^8 layers."""
    pad = Raw(ARRAY, struct.pack("<IQ", U8, 100_000) + b"\0" * 100_000)
    return small_llama(path, small_metadata(block_count=100_000_000, **{"general.pad": pad}))


def _bomb_array(path: Path) -> Path:
    """~8 MB: one 2M-element int32 array where the token types go."""
    types = Raw(ARRAY, struct.pack("<IQ", I32, 2_000_000) + b"\1\0\0\0" * 2_000_000)
    return small_llama(path, small_metadata(**{"tokenizer.ggml.token_type": types}))


def _bomb_offset(path: Path) -> Path:
    """A tensor whose offset is 2^64 - 32: in 64-bit arithmetic it wraps onto the header."""
    path = small_llama(path)
    data = bytearray(path.read_bytes())
    name = b"token_embd.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name) + 4 + 16 + 4
    data[at : at + 8] = struct.pack("<Q", 2**64 - 32)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (_bomb_block_count, "block_count 100000000 but the file holds tensors of 1 blocks"),
        (_bomb_array, "2000000 elements, more than spill reads"),
        (_bomb_offset, "lie past the end of the file"),
    ],
)
def test_a_gguf_bomb_is_one_line_in_bounded_memory_and_time(
    tmp_path, spill_home, baseline, make, says
):
    path = make(tmp_path / "bomb.gguf")
    rc, _, err, rss, seconds = spill("models", "import", str(path))
    assert says in one_line_refusal(rc, err, path)
    nothing_cached(spill_home)
    print(
        f"\n{path.stat().st_size} bytes: peak RSS {rss / MB:.0f} MB (baseline {baseline / MB:.0f} MB), {seconds:.1f} s"
    )
    assert rss < baseline + 300 * MB and seconds < 60


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"embedding_length": "abc"}, "'llama.embedding_length' is 'abc', not an integer"),
        ({"attention.layer_norm_rms_epsilon": "x"}, "is 'x', not a number"),
        ({"attention.head_count": 0}, "head_count' is 0, not an integer of at least 1"),
        ({"tokenizer.ggml.tokens": [1, 2, 3, 4, 5]}, "not a list of strs"),
    ],
)
def test_metadata_of_the_wrong_type_is_one_line(tmp_path, spill_home, changes, says):
    path = small_llama(tmp_path / "bad.gguf", small_metadata(**changes))
    rc, _, err, _, _ = spill("models", "import", str(path))
    assert says in one_line_refusal(rc, err, path)
    nothing_cached(spill_home)


@pytest.mark.parametrize(
    ("file", "flags"),
    [("smollm2:135m.gguf", ()), ("smollm2-135m.gguf", ("--dequantize",))],
)
def test_an_import_never_lands_in_an_aliases_folder(tmp_path, spill_home, file, flags):
    """Other bytes named like an alias are refused; the alias's folders stay empty."""
    path = small_llama(tmp_path / file)
    rc, _, err, _, _ = spill("models", "import", str(path), *flags)
    assert "not the GGUF smollm2:135m pins" in one_line_refusal(rc, err, path)
    nothing_cached(spill_home)
    rc, _, err, _, _ = spill("models", "import", str(path), "--name", "smollm2:135m@q4_1")
    assert "smollm2-135m-q4_1" in one_line_refusal(rc, err, path)
    nothing_cached(spill_home)


def test_a_folder_of_another_origin_is_never_reused(tmp_path, spill_home):
    first, other = small_llama(tmp_path / "a.gguf"), small_llama(tmp_path / "b.gguf", seed=1)
    rc, out, err, _, _ = spill("models", "import", str(first), "--name", "mine")
    assert rc == 0, err
    folder = Path(out.strip().splitlines()[-1])
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    rc, _, err, _, _ = spill("models", "import", str(other), "--name", "mine")
    assert "already holds another model" in one_line_refusal(rc, err, other)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    rc, out, err, _, _ = spill("models", "import", str(first), "--name", "mine")
    assert rc == 0 and Path(out.strip().splitlines()[-1]) == folder, err


def test_the_name_an_import_prints_is_what_verbs_take(tmp_path, spill_home):
    """``<stem>@<type>`` (and ``<stem>`` for --dequantize): ``spill run`` and a project's
    ``model.name`` take it as ``spill models list`` shows it."""
    path = small_llama(tmp_path / "mine.gguf", q8=True)
    rc, _, err, _, _ = spill("models", "import", str(path))
    assert rc == 0, err
    rc, _, err, _, _ = spill("models", "import", str(path), "--dequantize")
    assert rc == 0, err
    rc, out, err, _, _ = spill("models", "list", "--json")
    names = {m["name"] for m in json.loads(out)}
    assert {"mine@q8_0", "mine"} <= names, names
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "ab"}) + "\n")
    for name in ("mine@q8_0", "mine"):
        out = tmp_path / f"{name}.jsonl"
        rc, _, err, _, _ = spill(
            "run", name, str(rows), "--out", str(out), "--max-new-tokens", "2", cwd=tmp_path
        )
        assert rc == 0, err
        assert json.loads(out.read_text())["id"] == "a"
    from spill.project.build.specs import check_model_name

    check_model_name("mine@q8_0", "model.name")  # a spill.yaml naming it validates


def test_tune_eval_and_export_take_the_imported_name(tmp_path, spill_home):
    path = small_llama(tmp_path / "mine.gguf", q8=True)
    assert spill("models", "import", str(path))[0] == 0
    train, rows = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text(json.dumps({"prompt": "ab a", "completion": " b ab"}) + "\n")
    rows.write_text(json.dumps({"id": "a", "prompt": "ab", "answer": "b"}) + "\n")
    state = tmp_path / "state"
    rc, _, err, _, _ = spill(
        "tune", "mine@q8_0", str(train), "--name", "t", "--state", str(state), "--steps", "1",
        "--batch", "1", "--micro-batch", "1", "--seq-len", "16",
    )  # fmt: skip
    assert rc == 0, err
    rc, out, err, _, _ = spill("eval", "mine@q8_0", str(rows), "--adapter", str(state / "adapter"))
    assert rc == 0 and "accuracy" in out, err
    rc, out, err, _, _ = spill("export", str(state / "adapter"), str(tmp_path / "merged"))
    assert rc == 0 and (tmp_path / "merged" / "config.json").is_file(), err
