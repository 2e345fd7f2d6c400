"""Validation loss in ``spill tune`` (``--valid FILE --eval-every N --keep-best``), through the
real CLI: it is committed with the checkpoints, so a run SIGKILLed at named boundaries and rerun
has the very same validation losses and exports the very same best adapter as the uninterrupted
one (float32, compared exactly); a checkpoint continues only with the validation it was made
with; another engine continuing the run measures the same losses within rounding; a run over
two processes measures what one process does.

The run: 12 steps at a learning rate high enough that the validation loss (rows of another
form than the training rows) is lowest at step 6, between two checkpoints (4 and 8), so the best
adapter is neither the last nor one that a checkpoint holds as its parameters.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from spill.payloads.checkpoint import PARAMS
from tests.func import tune_kit as kit

OVER = {"steps": 12, "ckpt_every": 4, "lr": 0.3, "eval_every": 2, "keep_best": True}
VALID_STEPS = [2, 4, 6, 8, 10, 12]


def write_valid(path: Path) -> Path:
    rows = [{"prompt": f"Say {i} twice:", "completion": f" {i} {i}."} for i in range(6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_models) -> dict:
    base = tmp_path_factory.mktemp("valid")
    return {
        "model": tiny_models["llama"],
        "train": kit.write_train(base / "train.jsonl"),
        "valid": write_valid(base / "valid.jsonl"),
    }


def argv(files: dict, state: str, **over) -> list[str]:
    over = {**OVER, "valid": files["valid"], **over}
    return [*kit.tune_argv(files["model"], files["train"], state, **over), "--json"]


@pytest.fixture(scope="module")
def control(files, tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("valid-control")
    state = str(base / "state")
    done = kit.run_tune(argv(files, state), kit.spill_env(base / "home"))
    assert done.returncode == 0, done.stderr
    return {"state": state, "summary": json.loads(done.stdout), "stderr": done.stderr}


def final(state: str) -> dict:
    return kit.state_json(state, 12)


def test_the_validation_loss_is_committed_and_the_best_adapter_exported(control, files, tmp_path):
    s = final(control["state"])
    assert [v[0] for v in s["valid"]] == VALID_STEPS
    losses = [v[1] for v in s["valid"]]
    best = int(np.argmin(losses))
    assert 0 < best < len(losses) - 1, f"the loss must turn for this test to mean much: {losses}"
    assert s["best"] == {"step": VALID_STEPS[best], "loss": losses[best]}
    summary = control["summary"]
    assert summary["valid_loss"] == round(losses[-1], 6)
    assert summary["best_step"] == VALID_STEPS[best]
    assert f"adapter of step {VALID_STEPS[best]} (the lowest validation loss)" in control["stderr"]
    meta = json.loads((Path(control["state"]) / "adapter" / "adapter.json").read_text())
    assert meta["validation"] == {
        "losses": s["valid"],
        "kept": "best",
        "step": VALID_STEPS[best],
        "loss": losses[best],
    }
    # the exported parameters are that step's: a run stopped there holds the same tensors
    stopped = str(tmp_path / "stopped")
    done = kit.run_tune(
        argv(files, stopped, stop_after=VALID_STEPS[best]), kit.spill_env(tmp_path / "home")
    )
    assert done.returncode == 0, done.stderr
    want = kit.tensors(kit.files(stopped, VALID_STEPS[best])[PARAMS])
    got = kit.tensors((Path(control["state"]) / "adapter" / "params.safetensors").read_bytes())
    assert sorted(got) == sorted(want)
    assert all(np.array_equal(got[k], want[k]) for k in want)
    assert kit.state_json(stopped, VALID_STEPS[best])["valid"] == s["valid"][: best + 1]
    # without --keep-best the last step's adapter is exported, with the same losses measured
    last = str(tmp_path / "last")
    done = kit.run_tune(argv(files, last, keep_best=None), kit.spill_env(tmp_path / "home"))
    assert done.returncode == 0, done.stderr
    assert final(last)["valid"] == s["valid"] and "best" not in final(last)
    meta = json.loads((Path(last) / "adapter" / "adapter.json").read_text())
    assert meta["validation"] == {"losses": s["valid"], "kept": "last"}
    # measuring changes nothing of the training: a run without validation, the same tensors
    plain = str(tmp_path / "plain")
    done = kit.run_tune(
        argv(files, plain, valid=None, keep_best=None), kit.spill_env(tmp_path / "home")
    )
    assert done.returncode == 0, done.stderr
    assert final(plain)["losses"] == final(last)["losses"] and "valid" not in final(plain)
    a, b = (kit.tensors(kit.files(x, 12)[PARAMS]) for x in (plain, last))
    assert all(np.array_equal(a[k], b[k]) for k in b)


# (drill, the step committed when it fires): step 6 is the best one; the kill after step 10
# leaves the step 8 checkpoint, whose best::<param> tensors are step 6's
DRILLS = [
    pytest.param("tune-after-optimizer@3", None, marks=pytest.mark.slow),
    ("tune-after-optimizer@7", 4),
    ("tune-after-optimizer@10", 8),
    ("ckpt-after-commit@2", 8),
]
IDS = [
    "tune-after-optimizer@3",
    "tune-after-optimizer@7",
    "tune-after-optimizer@10",
    "ckpt-after-commit@2",
]


@pytest.mark.parametrize("drill, committed", DRILLS, ids=IDS)
def test_sigkill_then_rerun_has_the_same_validation_and_best_adapter(
    control, files, tmp_path, drill, committed
):
    state = str(tmp_path / "state")
    env = kit.spill_env(tmp_path / "home")
    killed = kit.run_tune(argv(files, state), {**env, "SPILL_DRILL": drill})
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert kit.latest_step(state) == committed
    if committed:
        got = kit.state_json(state, committed)["valid"]
        assert got == final(control["state"])["valid"][: committed // 2]
    done = kit.run_tune(argv(files, state), env)
    assert done.returncode == 0, done.stderr
    assert kit.resumed_from(done.stderr, steps=12) == committed
    kit.assert_same_checkpoint(state, control["state"], 12)  # valid and best included
    assert kit.adapter_files(state) == kit.adapter_files(control["state"])


def test_a_checkpoint_continues_only_with_its_validation(control, files, tmp_path):
    state = str(tmp_path / "state")
    env = kit.spill_env(tmp_path / "home")
    done = kit.run_tune(argv(files, state, stop_after=4), env)
    assert done.returncode == 0, done.stderr
    cases = {
        "without": (
            {"valid": None, "keep_best": None},
            "made with validation (--valid), this run ",
        ),
        "other file": ({"valid": files["train"]}, "made with validation file 'sha256:"),
        "every": ({"eval_every": 3}, "made with --eval-every 2, this run has 3"),
    }
    for over, words in cases.values():
        refused = kit.run_tune(argv(files, state, **over), env)
        assert refused.returncode != 0 and words in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert kit.latest_step(state) == 4  # nothing lost
    bad = kit.run_tune(argv(files, str(tmp_path / "x"), valid=None), env)
    assert bad.returncode != 0
    assert "--keep-best picks by validation loss; give --valid FILE too" in bad.stderr


@pytest.mark.slow  # (12 s; CI's time budget)
def test_two_processes_measure_what_one_does(control, files, tmp_path):
    state = str(tmp_path / "state")
    env = kit.spill_env(tmp_path / "home", OMP_NUM_THREADS="1")
    one = str(tmp_path / "one")
    assert kit.run_tune(argv(files, one), env).returncode == 0
    done = kit.run_tune(argv(files, state, procs=2), env)
    assert done.returncode == 0, done.stderr
    assert final(state)["valid"] == final(one)["valid"]
    assert final(state)["best"] == final(one)["best"]


@pytest.mark.mlx
@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="mlx is not installed")
def test_mlx_continues_a_torch_run_and_measures_the_same_losses_within_rounding(
    control, files, tmp_path
):
    state = str(tmp_path / "state")
    env = kit.spill_env(tmp_path / "home")
    # dropout masks differ between engines by design; at --lr 0.3 the engines' rounding grows
    # into percents within 12 steps (measured: 1.9% at step 10), at 0.01 it stays rounding
    over = {"dropout": 0.0, "lr": 0.01, "keep_best": None}
    torch_run = str(tmp_path / "torch")
    assert kit.run_tune(argv(files, torch_run, **over), env).returncode == 0
    assert kit.run_tune(argv(files, state, stop_after=4, **over), env).returncode == 0
    done = kit.run_tune(argv(files, state, engine="mlx", **over), env)
    assert done.returncode == 0, done.stderr
    got, want = final(state)["valid"], final(torch_run)["valid"]
    assert got[:2] == want[:2]  # committed by torch, carried over as they were
    assert [s for s, _ in got] == [s for s, _ in want]
    worst = max(abs(a - b) / abs(b) for (_, a), (_, b) in zip(got, want, strict=True))
    print(f"\nvalidation loss, torch then mlx vs torch alone: {worst:.3g} (relative, max)")
    assert worst <= 1e-5, (got, want)  # measured 1.4e-07 (2-core EPYC, float32)


def test_a_build_carves_validation_rows_off_the_training_split(tmp_path):
    from tests.func.test_build import copy_toy, spill, state_doc

    project = copy_toy(tmp_path / "toy")
    home = tmp_path / "home"
    over = ["tune.valid=24", "tune.steps=30", "tune.ckpt_every=10", "tune.eval_every=10"]
    spill("build", str(project), *over, "tune.keep_best=true", home=home)
    doc = state_doc(project / ".spill")
    assert (doc["data"]["train"], doc["data"]["valid"], doc["data"]["test"]) == (337, 24, 39)
    tune = doc["stages"]["tune"]
    assert tune["inputs"]["tune.valid"] == 24 and "data:valid.jsonl" in tune["inputs"]
    result = tune["result"]
    (folder,) = (project / ".spill" / tune["location"] / "payloads").glob("ckpt-*-s30-*")
    state = json.loads((folder / "state.json").read_text())
    assert [s for s, _ in state["valid"]] == [10, 20, 30]
    assert result["valid_loss"] == round(state["valid"][-1][1], 6)
    assert result["best_step"] == state["best"]["step"]
    status = spill("status", str(project), home=home).stdout
    assert f"validation {result['valid_loss']:.4f}, exported step {result['best_step']}" in status
    assert "tune valid  " in status and "(3 points)" in status  # the validation sparkline
    spill("report", str(project), home=home)
    page = (project / "report.html").read_text()
    assert "337 to train on, 24 to validate, 39 held out" in page and "validation" in page
    # up to date as it is; without validation the stage's inputs are those of before
    again = spill("build", str(project), *over, "tune.keep_best=true", "--json", home=home)
    assert {s["action"] for s in json.loads(again.stdout)["plan"]} == {"done", "skip"}
    plain = spill("build", str(project), "--dry-run", "--json", home=home)
    assert json.loads(plain.stdout)["plan"][2]["action"] == "run"  # tune.valid off: retrain
