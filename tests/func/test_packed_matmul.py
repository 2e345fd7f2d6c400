"""``--packed-matmul`` through the real CLI, on a tiny llama's 4-bit copy (hidden 128: every
linear's rows come in the int4 kernel's blocks of 64). A row job computes on the kernel's file,
made once per home, records ``bfloat16+int4mm`` in its segments, and a SIGKILLed run resumes to
the uninterrupted run's bytes with no row lost or repeated; a tune says in one line that it
dequantizes instead and trains exactly as without the flag; float32 with it is refused in one
line."""

from __future__ import annotations

import json
from pathlib import Path

from spill.store.location import location
from tests.conftest import run_spill
from tests.func import tune_kit as kit

MODEL = "tiny:llama:3:2x128"
QUANT = ["--quantize", "4", "--group-size", "32"]
ROWS = 60
MADE = "wrote the int4 kernel's layout"


def _run(home: Path, *args: str, **env: str):
    return run_spill(*args, env={"SPILL_HOME": str(home), "OMP_NUM_THREADS": "1", **env})


def test_a_row_job_records_the_kernel_and_resumes_to_the_same_bytes(tmp_path):
    from spill.control.place import Place
    from spill.payloads.rows import commit_markers

    home = tmp_path / "home"
    src = tmp_path / "in.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": f"row {i}"}) + "\n" for i in range(ROWS))
    )
    args = [
        "run",
        MODEL,
        str(src),
        *QUANT,
        "--packed-matmul",
        "--max-new-tokens",
        "6",
        "--batch",
        "2",
    ]
    ref = _run(home, *args, "--out", str(tmp_path / "ref.jsonl"))
    assert ref.returncode == 0, ref.stderr
    assert (
        ref.stderr.count(MADE) == 1 and "numerics bfloat16+int4mm (--packed-matmul)" in ref.stderr
    )
    state, out = str(tmp_path / "state"), tmp_path / "out.jsonl"
    killed = _run(
        home, *args, "--out", str(out), "--state", state, SPILL_DRILL="seg-before-commit@2"
    )
    assert killed.returncode == -9, killed.stderr
    assert MADE not in killed.stderr  # made once for this home
    rerun = _run(home, *args, "--out", str(out), "--state", state)
    assert rerun.returncode == 0, rerun.stderr
    assert out.read_text() == (tmp_path / "ref.jsonl").read_text()
    markers = commit_markers(Place(location(state)))
    ids = [rid for m in markers for rid in m["row_ids"]]
    assert sorted(ids) == sorted(f"r{i}" for i in range(ROWS))  # each row exactly once
    assert {m["producer"]["numerics"] for m in markers} == {"bfloat16+int4mm"}


def test_a_tune_dequantizes_instead_and_trains_as_without_it(tmp_path):
    env = kit.spill_env(tmp_path / "home")
    train = kit.write_train(tmp_path / "train.jsonl")
    control = str(tmp_path / "control")
    made = kit.run_tune(kit.tune_argv(MODEL, train, control, quantize=4, group_size=32), env)
    assert made.returncode == 0, made.stderr
    state = str(tmp_path / "flag")
    argv = kit.tune_argv(MODEL, train, state, quantize=4, group_size=32, packed_matmul=True)
    flagged = kit.run_tune(argv, env)
    assert flagged.returncode == 0, flagged.stderr
    assert "--packed-matmul is for row jobs (no gradient); dequantized per use" in flagged.stderr
    assert MADE not in flagged.stderr and "numerics float32" in flagged.stderr
    kit.assert_same_checkpoint(state, control)


def test_float32_with_it_is_refused_in_one_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "hello"}) + "\n")
    proc = _run(
        tmp_path / "home",
        *["run", MODEL, str(src), "--out", str(tmp_path / "o.jsonl"), *QUANT],
        *["--packed-matmul", "--dtype", "float32"],
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("spill: error:")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr
    assert "--packed-matmul computes in bfloat16" in errors[0]
    assert "Traceback" not in proc.stderr and not (tmp_path / "o.jsonl").exists()
