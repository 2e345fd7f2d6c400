"""The real CLI in subprocesses: help without heavy imports, spill run end to end, bad input."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ENGINES, assert_not_imported, cli_code, run_spill

SUBCOMMANDS = [
    [],
    *(
        [v]
        for v in (
            *"run eval distill tune init build status resume report models export".split(),
            "predict",
            "chat",
        )
    ),
]
SUBCOMMANDS += [["models", "import"], ["models", "tiny"], ["models", "list"]]


@pytest.mark.parametrize("sub", SUBCOMMANDS, ids=lambda s: " ".join(s) or "top")
def test_help_imports_neither_torch_nor_mlx(sub):
    proc = assert_not_imported(cli_code(*sub, "--help"), (*ENGINES, "transformers"))
    assert "usage: spill" in proc.stdout


def test_usage_error_exits_2():
    proc = run_spill("run")
    assert proc.returncode == 2
    assert "usage:" in proc.stderr


def _prompts(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_run_end_to_end(tmp_path, tiny_models):
    src = _prompts(
        tmp_path / "in.jsonl",
        [
            {"id": "a", "prompt": "hello"},
            {"id": 2, "messages": [{"role": "user", "content": "hi there"}]},
            {"id": "c", "prompt": "a longer prompt than the others"},
        ],
    )
    out = tmp_path / "out.jsonl"
    proc = run_spill(
        "run",
        str(tiny_models["qwen2"]),
        str(src),
        "--out",
        str(out),
        "--max-new-tokens",
        "5",
        "--dtype",
        "float32",
        "--batch",
        "2",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    assert "engine torch" in proc.stderr and "numerics float32" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", 2, "c"]
    assert all(isinstance(r["output"], str) and 1 <= r["tokens"] <= 5 for r in rows)
    summary = json.loads(proc.stdout)
    assert summary["rows"] == 3 and summary["generated_tokens"] == sum(r["tokens"] for r in rows)


def test_run_streamed_equals_resident_and_batching(tmp_path, tiny_models):
    src = _prompts(
        tmp_path / "in.jsonl",
        [{"id": i, "prompt": p} for i, p in enumerate(["one", "two three", "four five six"])],
    )
    outs = {}
    for mode in (["--ring", "2"], ["--resident"]):
        out = tmp_path / f"out{mode[0]}.jsonl"
        proc = run_spill(
            "run",
            str(tiny_models["llama"]),
            str(src),
            "--out",
            str(out),
            "--max-new-tokens",
            "6",
            "--dtype",
            "float32",
            "--batch",
            "3",
            *mode,
        )
        assert proc.returncode == 0, proc.stderr
        outs[mode[0]] = out.read_text()
    assert outs["--ring"] == outs["--resident"]


BAD_ROWS = {
    "not-json": ("{not json}\n", "not valid JSON"),
    "no-prompt": ('{"id": 1, "text": "x"}\n', "has no 'prompt'"),
    "bad-messages": ('{"id": 1, "messages": "hi"}\n', "'messages' must be"),
    "dup-id": ('{"id": 1, "prompt": "a"}\n{"id": 1, "prompt": "b"}\n', "repeats line 1"),
    "empty": ("\n", "no rows"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_bad_input_rows(case, tmp_path, tiny_models):
    text, message = BAD_ROWS[case]
    src = tmp_path / "in.jsonl"
    src.write_text(text)
    out = tmp_path / "out.jsonl"
    proc = run_spill("run", str(tiny_models["llama"]), str(src), "--out", str(out))
    assert proc.returncode == 1
    assert message in proc.stderr and str(src) in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists() and not list(tmp_path.glob(".out.jsonl*"))


def _copy_model(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_bad_models(tmp_path, tiny_models):
    src = _prompts(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x"}])
    out = tmp_path / "out.jsonl"

    def fails(model, message):
        proc = run_spill("run", str(model), str(src), "--out", str(out))
        assert proc.returncode == 1, proc.stderr
        assert message in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert not out.exists()

    m = _copy_model(tiny_models["llama"], tmp_path / "truncated")
    shard = m / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    fails(m, "truncated")

    m = _copy_model(tiny_models["llama"], tmp_path / "notok")
    (m / "tokenizer.json").unlink()
    fails(m, "tokenizer.json")

    m = _copy_model(tiny_models["llama"], tmp_path / "family")
    cfg = json.loads((m / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (m / "config.json").write_text(json.dumps(cfg))
    fails(m, "model_type 'gpt2' is not supported")

    fails("qwen9:1b", "unknown")


def test_weights_stage_once_then_nothing(tmp_path, tiny_models):
    src = _prompts(tmp_path / "in.jsonl", [{"id": 1, "prompt": "x"}])
    env = {"SPILL_HOME": str(tmp_path / "home")}
    lines = []
    for _ in range(2):
        out = tmp_path / "out.jsonl"
        proc = run_spill(
            "run",
            "tinyq",
            str(src),
            "--out",
            str(out),
            "--max-new-tokens",
            "2",
            "--weights",
            str(tiny_models["qwen2"]),
            env=env,
        )
        assert proc.returncode == 0, proc.stderr
        lines.append(next(line for line in proc.stderr.splitlines() if line.startswith("staged")))
    assert "0 skipped" in lines[0] and not lines[0].startswith("staged 0 files")
    assert lines[1].startswith("staged 0 files, 0.0 MB") and "skipped" in lines[1]
