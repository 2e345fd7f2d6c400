"""A preference tune has everything a tune has: real processes, real signals, exact checks.

The standard run of ``tune_kit`` (a tiny llama streamed through a ring of 2, float32, LoRA dropout
0.1, 6 steps of 2 micro-batches) on prompt/chosen/rejected rows with ``--method dpo``. SIGKILL at
random moments (in a step's reference forward or its training, a save, the adapter's publication), then
the same command again: every checkpoint tensor, the state (losses, metrics, reference log-probs)
and the adapter equal the uninterrupted run's. Resident (kept activations) and ``--procs 2`` write
the streamed run's bits; ORPO stopped and continued equals ORPO uninterrupted; a DPO run moved to
MLX stays within the cross-engine distance measured for this command.
"""

from __future__ import annotations

import importlib.util
import json
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from spill.jobs.tune.data import rows_at
from tests.func import tune_kit as kit

STEPS = kit.STEPS
WORDS = "red green blue cat dog sun moon tree sky river stone bird".split()
# torch -> MLX for DPO with dropout 0 on this command: the moved run's final adapter against the
# torch-only run's, relative L2; measured 2.3e-08 here (the test prints it). Bounded by twice the
# distance pinned for SFT's moves (test_cross_engine's D[0.0]: 5.1e-6), as a move may cost
MOVED = 2 * 5.1e-6


def write_pairs(path: Path, n: int = 24) -> Path:
    rng = random.Random(7)
    rows = []
    for i in range(n):
        prompt = f"Question {i}: name a thing like " + " ".join(rng.sample(WORDS, 2))
        rows.append(
            {
                "prompt": prompt,
                "chosen": " " + rng.choice(WORDS) + ".",
                "rejected": " I do not know " + " ".join(rng.sample(WORDS, 3)) + ".",
            }
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def argv(model, train, state, method="dpo", **over) -> list[str]:
    return kit.tune_argv(model, train, str(state), method=method, **over)


@pytest.fixture(scope="module")
def dpo(tmp_path_factory, tiny_models):
    """The uninterrupted DPO run and how long it took from its pre-run line to its end."""
    base = tmp_path_factory.mktemp("dpo-control")
    train = write_pairs(base / "pairs.jsonl")
    state = base / "state"
    w = kit.Worker(argv(tiny_models["llama"], train, state), kit.spill_env(base / "home"))
    assert w.wait_for(kit.PRE_RUN)
    t0 = time.monotonic()
    done = w.finish()
    assert done.returncode == 0, done.stderr
    return {
        "model": tiny_models["llama"],
        "train": train,
        "state": str(state),
        "window": time.monotonic() - t0,
        "home": base / "home",
    }


def same_run(state: str, control: str) -> dict:
    kit.assert_same_checkpoint(state, control)
    assert kit.adapter_files(state) == kit.adapter_files(control)
    return kit.state_json(state, STEPS)


def test_the_run_commits_its_reference_and_metrics(dpo):
    got = kit.state_json(dpo["state"], STEPS)
    assert got["hyperparameters"]["method"] == "dpo" and got["hyperparameters"]["beta"] == 0.1
    assert len(got["reference"]["chosen"]) == len(got["reference"]["rejected"]) == 24
    assert len(got["metrics"]) == STEPS
    first = got["metrics"][0]
    # step 1: the adapter is zero, so the policy is the reference: every reward is exactly 0
    assert first["rewards/chosen"] == first["rewards/rejected"] == 0.0
    assert first["rewards/accuracies"] == 0.0
    assert got["losses"][0] == pytest.approx(np.log(2), abs=1e-12)
    assert got["metrics"][-1]["rewards/margins"] > 0
    status = kit.run_tune(["status", dpo["state"]], kit.spill_env(dpo["home"]))
    last = got["metrics"][-1]
    shown = f"DPO reward accuracy {last['rewards/accuracies']:.3f}, margin {last['rewards/margins']:.3f}"
    assert status.returncode == 0 and shown in status.stdout, status.stdout


@pytest.mark.parametrize("case", range(3))
def test_sigkill_at_a_random_moment_then_rerun_equals_the_control(dpo, tmp_path, case):
    env = kit.spill_env(tmp_path / "home")
    # case 0 lands in the first tenth of the run (step 1, its reference forward), the others anywhere
    fraction = random.Random(case).uniform(0.0, 0.1 if case == 0 else 1.0)
    for attempt in range(5):
        state = tmp_path / f"state-{attempt}"
        w = kit.Worker(argv(dpo["model"], dpo["train"], state), env)
        if w.wait_for(kit.PRE_RUN):
            time.sleep(fraction * dpo["window"] * 0.5**attempt)
            w.proc.send_signal(signal.SIGKILL)
        killed = w.finish()
        if killed.returncode == -signal.SIGKILL:
            break
    assert killed.returncode == -signal.SIGKILL, "the run finished before every kill"
    committed = kit.latest_step(str(state))
    done = kit.run_tune(argv(dpo["model"], dpo["train"], state), env)
    assert done.returncode == 0, done.stderr
    assert kit.resumed_from(done.stderr) == committed
    same_run(str(state), dpo["state"])


def test_resident_writes_the_streamed_bits(dpo, tmp_path):
    state = tmp_path / "state"
    done = kit.run_tune(
        argv(dpo["model"], dpo["train"], state, resident=True), kit.spill_env(tmp_path / "home")
    )
    assert done.returncode == 0, done.stderr
    assert "activations kept" in done.stderr
    same_run(str(state), dpo["state"])


def test_two_processes_write_the_bits_of_one(dpo, tmp_path):
    state = tmp_path / "state"
    done = kit.run_tune(
        [*argv(dpo["model"], dpo["train"], state), "--procs", "2"],
        kit.spill_env(tmp_path / "home", OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, done.stderr
    mine, theirs = kit.state_json(str(state), STEPS), kit.state_json(dpo["state"], STEPS)
    assert mine["losses"] == theirs["losses"] and mine["metrics"] == theirs["metrics"]
    a = kit.tensors(kit.files(str(state), STEPS)["params.safetensors"])
    b = kit.tensors(kit.files(dpo["state"], STEPS)["params.safetensors"])
    assert all(np.array_equal(a[k], b[k]) for k in b)


def test_orpo_stopped_and_continued_equals_uninterrupted(dpo, tmp_path):
    env = kit.spill_env(tmp_path / "home")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert kit.run_tune(argv(dpo["model"], dpo["train"], whole, "orpo"), env).returncode == 0
    first = kit.run_tune(argv(dpo["model"], dpo["train"], parts, "orpo", stop_after=3), env)
    assert first.returncode == 0, first.stderr
    done = kit.run_tune(argv(dpo["model"], dpo["train"], parts, "orpo"), env)
    assert done.returncode == 0 and kit.resumed_from(done.stderr) == 3, done.stderr
    got = same_run(str(parts), str(whole))
    assert "reference" not in got and "nll_loss" in got["metrics"][-1]


def test_a_dpo_checkpoint_refuses_sft_and_another_beta(dpo, tmp_path):
    env = kit.spill_env(tmp_path / "home")
    state = tmp_path / "state"
    assert kit.run_tune(argv(dpo["model"], dpo["train"], state, stop_after=2), env).returncode == 0
    sft = kit.run_tune(argv(dpo["model"], dpo["train"], state, "sft"), env)
    assert sft.returncode != 0
    assert "a preference row (chosen/rejected) in a supervised tune" in sft.stderr
    beta = kit.run_tune(argv(dpo["model"], dpo["train"], state, beta=0.2), env)
    assert beta.returncode != 0 and "beta 0.1, this run has 0.2" in beta.stderr
    orpo = kit.run_tune(argv(dpo["model"], dpo["train"], state, "orpo"), env)
    assert orpo.returncode != 0 and "is a DPO run, this one ORPO" in orpo.stderr


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="the mlx extra")
def test_a_dpo_run_moved_to_mlx_stays_within_the_engines_distance(dpo, tmp_path):
    env = kit.spill_env(tmp_path / "home")
    torch_only, moved = tmp_path / "torch", tmp_path / "moved"
    common = {"dropout": 0.0}
    assert kit.run_tune(argv(dpo["model"], dpo["train"], torch_only, **common), env).returncode == 0
    leg = kit.run_tune(argv(dpo["model"], dpo["train"], moved, stop_after=3, **common), env)
    assert leg.returncode == 0, leg.stderr
    done = kit.run_tune(argv(dpo["model"], dpo["train"], moved, engine="mlx", **common), env)
    assert done.returncode == 0, done.stderr
    mine, theirs = kit.state_json(str(moved), STEPS), kit.state_json(str(torch_only), STEPS)
    assert mine["losses"][:3] == theirs["losses"][:3]  # torch's own steps
    # the reference torch committed travels; MLX computes the pairs first taken after the move
    size, accum = kit.SETTINGS["micro_batch"], kit.ACCUM
    early = {r for i in range(3 * accum) for r in rows_at(24, kit.SETTINGS["seed"], i, size)}
    for k in ("chosen", "rejected"):
        a, b = np.array(mine["reference"][k]), np.array(theirs["reference"][k])
        assert all(a[r] == b[r] for r in early)
        assert np.allclose(a, b, rtol=1e-5)
    assert [p["engine"] for p in mine["producers"]] == ["torch", "mlx"]
    a = kit.tensors(kit.files(str(moved), STEPS)["params.safetensors"])
    b = kit.tensors(kit.files(str(torch_only), STEPS)["params.safetensors"])
    flat = [np.concatenate([x[k].ravel() for k in sorted(b)]) for x in (a, b)]
    distance = float(np.linalg.norm(flat[0] - flat[1]) / np.linalg.norm(flat[1]))
    print(f"torch -> MLX DPO: final adapter relative L2 distance {distance:.3g}")
    assert distance <= MOVED


def test_tensorboard_reads_each_steps_reward_metrics(dpo, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    state = tmp_path / "state"
    env = kit.spill_env(tmp_path / "home")
    first = kit.run_tune(
        [*argv(dpo["model"], dpo["train"], state, stop_after=3), "--log", "tensorboard"], env
    )
    assert first.returncode == 0, first.stderr
    done = kit.run_tune([*argv(dpo["model"], dpo["train"], state), "--log", "tensorboard"], env)
    assert done.returncode == 0, done.stderr
    acc = EventAccumulator(str(state / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    metrics = kit.state_json(str(state), STEPS)["metrics"]
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"):
        got = [(e.step, e.value) for e in acc.Scalars(f"train/{name}")]
        assert [s for s, _ in got] == list(range(1, STEPS + 1))  # each step once, across the resume
        assert [v for _, v in got] == pytest.approx([m[name] for m in metrics], rel=1e-6)


def test_dpo_on_a_quantized_base_stops_and_continues_exactly(dpo, tiny_models, tmp_path):
    """QLoRA: the 4-bit copy of the tiny llama as the base (and as the reference)."""
    model = kit.quantized_tiny(tiny_models, tmp_path / "tiny-q4g32")
    env = kit.spill_env(tmp_path / "home")
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert kit.run_tune(argv(model, dpo["train"], whole), env).returncode == 0
    first = kit.run_tune(argv(model, dpo["train"], parts, stop_after=3), env)
    assert first.returncode == 0, first.stderr
    assert "4-bit" in first.stderr  # the pre-run line names the quantized weights
    done = kit.run_tune(argv(model, dpo["train"], parts), env)
    assert done.returncode == 0 and kit.resumed_from(done.stderr) == 3, done.stderr
    got = same_run(str(parts), str(whole))
    assert got["metrics"][0]["rewards/accuracies"] == 0.0  # the quantized base is the reference
    assert got["model"]["quantization"]["bits"] == 4


@pytest.mark.skipif(importlib.util.find_spec("mlx") is None, reason="the mlx extra")
def test_mlx_resident_writes_mlx_streamed_bits(dpo, tmp_path):
    """MLX's kept-activation walk takes an objective its own way (a forward for the weights, then
    one vjp); it must give the bits of its recompute walk, as for SFT."""
    env = kit.spill_env(tmp_path / "home")
    streamed, resident = tmp_path / "streamed", tmp_path / "resident"
    mlx = {"engine": "mlx", "steps": 3, "stop_after": None}
    assert kit.run_tune(argv(dpo["model"], dpo["train"], streamed, **mlx), env).returncode == 0
    done = kit.run_tune(argv(dpo["model"], dpo["train"], resident, resident=True, **mlx), env)
    assert done.returncode == 0 and "activations kept" in done.stderr, done.stderr
    kit.assert_same_checkpoint(str(resident), str(streamed), step=3)
