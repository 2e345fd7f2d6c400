"""What a job does with the paths it is given, through the real CLI (issue 8 items 1, 8, 10, and
``adapter.json``'s schema from item 6).

* An ``--out`` (or ``--state``) that is one of the command's inputs, reached by any path (``..``,
  a symlink, a hard link, a file of ``--adapter`` or of the model folder), is a usage error
  (exit 2) before the model loads, and the input is left byte for byte as it was.
* A ``--state`` that cannot be written (its parent is a regular file; an immutable folder, which
  stops root too) is refused in one line before the model loads, not at the first checkpoint.
* ``spill run --adapter`` generates exactly what ``spill eval --adapter`` generates, for both
  layouts, and the adapter is part of a ``--state``'s identity.
* A damaged ``adapter.json`` or ``adapter_config.json`` is one line naming the file.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from spill.ground.validate import validate
from tests.conftest import run_spill

ENV = {"OMP_NUM_THREADS": "1"}
GEN = ["--max-new-tokens", "6", "--dtype", "float32"]
PRE_RUN = " · model "  # the line printed once the model is loaded
PROMPTS = ["one", "two three", "Question 5: what is 5 plus 8?", "four"]


def _spill(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return run_spill(*args, env=ENV, cwd=cwd, timeout=120)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def folder(tmp_path, tiny_models) -> Path:
    """``work/`` with rows (answers too, so eval reads them), a model, and linked names."""
    work = tmp_path / "work"
    (work / "x").mkdir(parents=True)
    rows = [{"id": i, "prompt": p, "answer": "a"} for i, p in enumerate(PROMPTS)]
    _jsonl(work / "rows.jsonl", rows)
    shutil.copytree(tiny_models["llama"], work / "model")
    os.symlink("../rows.jsonl", work / "x" / "link.jsonl")
    os.link(work / "rows.jsonl", work / "hard.jsonl")
    (work / "adapter").mkdir()
    (work / "adapter" / "adapter.json").write_text("{}")
    return work


# verb, --out, extra arguments, what the message names
SAME_FILE = [
    ("run", "rows.jsonl", [], "the input file"),
    ("run", "./../work/rows.jsonl", ["--state", "st"], "the input file"),
    ("eval", "x/link.jsonl", [], "the input file"),
    ("eval", "hard.jsonl", ["--state", "st"], "the input file"),
    ("distill", "./x/../rows.jsonl", [], "the input file"),
    ("distill", "x/link.jsonl", ["--state", "st"], "the input file"),
    ("eval", "adapter/adapter.json", ["--adapter", "adapter"], "a file of --adapter adapter"),
    ("run", "adapter/adapter.json", ["--adapter", "adapter"], "a file of --adapter adapter"),
    ("run", "model/config.json", [], "a file of the model folder model"),
]


@pytest.mark.parametrize(("verb", "out", "extra", "what"), SAME_FILE)
def test_an_out_that_is_an_input_is_a_usage_error_before_anything_runs(
    folder, verb, out, extra, what
):
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    proc = _spill(verb, "model", "rows.jsonl", "--out", out, *GEN, *extra, cwd=folder)
    assert proc.returncode == 2, proc.stderr
    line = _one_line(proc)
    assert line.startswith("spill: error: --out ") and what in line, line
    assert "write the results elsewhere" in line
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert not (folder / "st").exists()  # refused before the state was touched


def test_a_state_that_is_the_input_is_a_usage_error(folder):
    before = (folder / "rows.jsonl").read_bytes()
    run = _spill(
        "run", "model", "rows.jsonl", "--out", "o.jsonl", "--state", "hard.jsonl", cwd=folder
    )
    tune = _spill(
        "tune", "model", "rows.jsonl", "--name", "t", "--state", "x/link.jsonl", cwd=folder
    )
    assert (run.returncode, tune.returncode) == (2, 2), run.stderr + tune.stderr
    assert "--state hard.jsonl is the input file" in _one_line(run)
    assert "--state x/link.jsonl is the training file" in _one_line(tune)
    assert (folder / "rows.jsonl").read_bytes() == before and not (folder / "o.jsonl").exists()


# --- a state that cannot be written -----------------------------------------------------------


def _train(path: Path) -> Path:
    rows = [
        {"prompt": f"Question {i}: what is {i} plus {i + 3}?", "completion": f" {2 * i + 3}."}
        for i in range(24)
    ]
    return _jsonl(path, rows)


def _refused_before_loading(proc: subprocess.CompletedProcess, state: str) -> None:
    assert proc.returncode == 1, proc.stderr
    line = _one_line(proc)
    assert f"state location {state} cannot be written" in line, line
    assert PRE_RUN not in proc.stderr and "step" not in proc.stderr


def test_a_state_under_a_regular_file_is_refused_before_the_model_loads(tmp_path, tiny_models):
    model, train = str(tiny_models["llama"]), _train(tmp_path / "train.jsonl")
    (tmp_path / "plain").write_text("a file, not a folder\n")
    state = str(tmp_path / "plain" / "state")  # mkdir fails there, even for root
    tune = _spill("tune", model, str(train), "--name", "t", "--state", state, "--steps", "2")
    _refused_before_loading(tune, state)
    rows = _jsonl(tmp_path / "rows.jsonl", [{"id": 0, "prompt": "one"}])
    out = tmp_path / "out.jsonl"
    run = _spill("run", model, str(rows), "--out", str(out), "--state", state, *GEN)
    _refused_before_loading(run, state)
    assert not out.exists()


@pytest.fixture
def immutable(tmp_path) -> Path:
    """A folder nobody, root included, can create files in (``chattr +i``), or a skip."""
    folder = tmp_path / "immutable"
    folder.mkdir()
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not permitted here (no CAP_LINUX_IMMUTABLE or filesystem)")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


def test_an_immutable_state_is_refused_before_any_step(immutable, tmp_path, tiny_models):
    train = _train(tmp_path / "train.jsonl")
    for state in (str(immutable), str(immutable / "new")):
        args = ["tune", str(tiny_models["llama"]), str(train), "--name", "t", "--state", state]
        _refused_before_loading(_spill(*args, "--steps", "2"), state)
    assert os.listdir(immutable) == []


# --- spill run --adapter ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, tiny_models) -> dict:
    """A tiny qwen2 adapter, tuned hard for 4 steps so that it changes greedy answers."""
    root = tmp_path_factory.mktemp("tuned")
    train, state = _train(root / "train.jsonl"), str(root / "state")
    proc = _spill(
        "tune", str(tiny_models["qwen2"]), str(train), "--name", "t", "--state", state,
        "--steps", "4", "--batch", "4", "--lr", "0.05", "--rank", "4", "--seq-len", "64",
        "--ckpt-every", "4", "--dtype", "float32",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = _jsonl(root / "rows.jsonl", [{"id": i, "prompt": p} for i, p in enumerate(PROMPTS)])
    graded = [{"id": i, "prompt": p, "answer": "a"} for i, p in enumerate(PROMPTS)]
    return {
        "model": str(tiny_models["qwen2"]),
        "adapter": Path(state) / "adapter",
        "rows": rows,
        "graded": _jsonl(root / "graded.jsonl", graded),
    }


def _run(tuned, out: Path, *extra: str) -> list[str]:
    proc = _spill("run", tuned["model"], str(tuned["rows"]), "--out", str(out), *GEN, *extra)
    assert proc.returncode == 0, proc.stderr
    return [r["output"] for r in _read(out)]


def _eval(tuned, out: Path, *extra: str) -> list[str]:
    proc = _spill("eval", tuned["model"], str(tuned["graded"]), "--out", str(out), *GEN, *extra)
    assert proc.returncode == 0, proc.stderr
    return [r["output"] for r in _read(out)]


@pytest.mark.parametrize("layout", ["spill", "peft"])
def test_run_with_an_adapter_generates_what_eval_does(tuned, tmp_path, layout):
    adapter = tuned["adapter"] if layout == "spill" else tuned["adapter"] / "peft"
    base = _run(tuned, tmp_path / "base.jsonl")
    with_adapter = _run(tuned, tmp_path / "run.jsonl", "--adapter", str(adapter))
    graded = _eval(tuned, tmp_path / "eval.jsonl", "--adapter", str(adapter))
    assert with_adapter == graded
    assert with_adapter != base


def test_the_adapter_is_part_of_a_run_states_identity(tuned, tmp_path):
    state = str(tmp_path / "state")
    first = _run(tuned, tmp_path / "a.jsonl", "--adapter", str(tuned["adapter"]), "--state", state)
    # the PEFT export of the same adapter is the same adapter: everything is restored
    again = _run(
        tuned, tmp_path / "b.jsonl", "--adapter", str(tuned["adapter"] / "peft"), "--state", state
    )
    assert again == first
    out = tmp_path / "c.jsonl"
    proc = _spill(
        "run", tuned["model"], str(tuned["rows"]), "--out", str(out), *GEN, "--state", state
    )
    assert proc.returncode == 1 and not out.exists()
    line = _one_line(proc)
    assert "holds rows of another job" in line and "adapter" in line, line
    assert PRE_RUN not in proc.stderr


# --- adapter.json and adapter_config.json -----------------------------------------------------


def test_the_published_adapter_json_has_a_schema_version_and_validates(tuned):
    doc = json.loads((tuned["adapter"] / "adapter.json").read_text())
    assert doc["schema_version"] == 1 and doc["format"] == "spill-lora"
    validate(doc, "adapter")


DAMAGE = {
    "not json": b'{"format": "spill-lora", "lora": {',
    "not utf-8": b'{"format": "spill-lora\xff"}',
    "a wrong type": b'{"format": "spill-lora", "lora": {"rank": "4", "alpha": 8, "targets": ["q_proj"]}}',
    "no lora": b'{"schema_version": 1, "format": "spill-lora"}',
    "a list": b"[1, 2]",
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("verb", ["run", "eval"])
def test_a_damaged_adapter_json_is_one_line_naming_it(tuned, tmp_path, damage, verb):
    adapter = tmp_path / "adapter"
    shutil.copytree(tuned["adapter"], adapter)
    (adapter / "adapter.json").write_bytes(DAMAGE[damage])
    rows = tuned["rows"] if verb == "run" else tuned["graded"]
    out = tmp_path / "out.jsonl"
    proc = _spill(verb, tuned["model"], str(rows), "--out", str(out), "--adapter", str(adapter))
    assert proc.returncode == 1 and not out.exists(), proc.stderr
    assert str(adapter / "adapter.json") in _one_line(proc)


@pytest.mark.parametrize(
    "text",
    [
        '{"r": 4, "lora_alpha": 8, "target_modules": ',
        '{"r": 4, "lora_alpha": 8, "target_modules": 7}',
        "[]",
    ],
)
def test_a_damaged_peft_config_is_one_line_naming_it(tuned, tmp_path, text):
    adapter = tmp_path / "peft"
    shutil.copytree(tuned["adapter"] / "peft", adapter)
    (adapter / "adapter_config.json").write_text(text)
    proc = _spill(
        "run",
        tuned["model"],
        str(tuned["rows"]),
        "--out",
        str(tmp_path / "o.jsonl"),
        "--adapter",
        str(adapter),
    )
    assert proc.returncode == 1, proc.stderr
    assert str(adapter / "adapter_config.json") in _one_line(proc)
