"""Kill drills on every 2026 family (issue 37): a real ``python -m spill tune`` of a
transformers-made Qwen3, Mistral (a window on every layer), SmolLM3 (a NoPE layer), Gemma 3
(sliding and full layers), Phi-3 (fused linears, partial rotary, longrope past its original 16
positions, a window), Ministral 3 (YaRN, query scaling) and Qwen3-MoE (on the attention, and
with adapters on every expert: "qwen3_moe-experts") is SIGKILLed by the parent at a random
moment after its first committed step, then the same command finishes it in a fresh process.

On torch the finished run is the uninterrupted one exactly: every adapter and AdamW tensor, the
losses, the cursor, the COMMIT bytes (``tune_kit.assert_same_checkpoint``) and the adapter tree
byte for byte, and the rerun continued from the newest step that verifies after the kill. On MLX
(a second kill of the same command, finished with ``--engine mlx``) the run is within
``test_cross_engine``'s bound of a clean torch and a clean MLX run, and its steps before the kill
are torch's own, exactly; the clean pair itself is within the pinned distance (Ministral 3,
absent from ``test_cross_engine_families``, is held to ``D`` here). A run SIGKILLed on MLX and
finished on MLX is the uninterrupted MLX run exactly, as on torch.

The runs are ``test_cross_engine``'s (six steps, a checkpoint every 2, a ring of 2, dropout 0, LoRA
on every linear); the killed runs save every step, so the kill falls after step 1's COMMIT at a
delay drawn (seeded per family) over what the clean run took from its first COMMIT to its adapter.
A kill that lands after the last step taught nothing: it is tried again with half the delay.
"""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.func import tune_kit as kit
from tests.func.test_cross_engine import (
    ACCUM,
    EPS,
    FACTOR,
    STEPS,
    D,
    Run,
    loss_distance,
    param_distance,
    tune_argv,
)
from tests.func.test_cross_engine_families import MODEL, OVER, PARAMS
from tests.unit.engines import hf_families
from tests.unit.engines.kit import load_engine

FAMILIES = ["qwen3", "mistral", "smollm3", "gemma3", "phi3-long", "ministral3", "qwen3_moe"]
FAMILIES += ["qwen3_moe-experts"]  # adapters on every expert too (``OVER``)


@dataclass(frozen=True)
class Family:
    model: Path
    train: Path
    env: dict
    clean: Run  # the uninterrupted torch run
    span: float  # seconds from its first COMMIT to "adapter written"
    over: dict  # the family's own options (``OVER``)

    def argv(self, state: str, engine: str = "torch", **over) -> list[str]:
        over = {"targets": "all", **self.over, **over}
        return tune_argv(self.model, self.train, state, engine=engine, dropout=0.0, **over)


_made: dict[str, Family] = {}


def family(variant: str, tmp_path_factory, tiny_models) -> Family:
    """The family's folder and its uninterrupted torch run, timed (made once per session)."""
    if variant not in _made:
        base = tmp_path_factory.mktemp(f"drill-{variant}")
        model = hf_families.make(MODEL.get(variant, variant), base / variant, tiny_models["llama"])
        train = kit.write_train(base / "train.jsonl")
        env = kit.spill_env(base / "home", OMP_NUM_THREADS="1")
        state = str(base / "clean")
        made = Family(model, train, env, Run(state, [], {}), 0.0, OVER.get(variant, {}))
        span = timed(made.argv(state), env, state)
        _made[variant] = Family(model, train, env, Run.read(state), span, made.over)
    return _made[variant]


def timed(argv: list[str], env: dict, state: str) -> float:
    """Run the command to the end; seconds from its first COMMIT to "adapter written"."""
    w = kit.Worker(argv, env)
    while not kit.commit_landed(state, 2) and w.proc.poll() is None:
        time.sleep(0.001)
    t0 = time.monotonic()
    assert w.wait_for("adapter written")
    span = time.monotonic() - t0
    done = w.finish()
    assert done.returncode == 0, done.stderr
    return span


def kill_after_first_commit(
    fam: Family,
    base: Path,
    seed: str,
    engine: str = "torch",
    clean: Run | None = None,
    span: float | None = None,
) -> tuple[str, int, str]:
    """SIGKILL the command (saving every step) on ``engine`` at a random moment (drawn over
    ``span``, the torch run's unless given) after step 1 is committed (published: the run points
    at it); the state, the newest step that verifies after the kill, and a note of when it fell.
    What the kill left is a prefix of ``clean`` (the torch run unless given)."""
    clean, span = clean or fam.clean, fam.span if span is None else span
    fraction = random.Random(seed).random()
    for attempt in range(6):
        state = str(base / f"killed-{engine}-{attempt}")
        delay = fraction * span * 0.5**attempt
        w = kit.Worker(fam.argv(state, engine, ckpt_every=1), fam.env)
        while not kit.commit_landed(state, 1) and w.proc.poll() is None:
            time.sleep(0.0005)
        while kit.latest_step(state) is None and w.proc.poll() is None:  # COMMIT, then pointer
            time.sleep(0.0005)
        time.sleep(delay)
        w.proc.send_signal(signal.SIGKILL)
        killed = w.finish()
        committed = kit.latest_step(state)
        if killed.returncode == -signal.SIGKILL and committed is not None and committed < STEPS:
            break
    assert killed.returncode == -signal.SIGKILL, (killed.returncode, killed.stderr[-3000:])
    assert committed is not None and 1 <= committed < STEPS, committed
    assert "adapter written" not in killed.stderr
    # the kill left a prefix of the uninterrupted run, exactly
    assert kit.state_json(state, committed)["losses"] == clean.losses[:committed]
    return state, committed, f"SIGKILL {delay * 1000:.0f} ms after step 1's COMMIT: {committed}"


@pytest.mark.parametrize("variant", FAMILIES)
def test_sigkill_on_torch_then_rerun_equals_the_uninterrupted_run(
    variant, tmp_path, tmp_path_factory, tiny_models
):
    fam = family(variant, tmp_path_factory, tiny_models)
    state, committed, note = kill_after_first_commit(fam, tmp_path, f"{variant}-torch")
    print(f"\n{variant}: {note}")
    done = kit.run_tune(fam.argv(state), fam.env)
    assert done.returncode == 0, done.stderr
    assert kit.resumed_from(done.stderr, STEPS, ACCUM) == committed
    kit.assert_same_checkpoint(state, fam.clean.state, STEPS, ACCUM)
    assert kit.adapter_files(state) == kit.adapter_files(fam.clean.state)
    assert kit.litter(state) == []


@pytest.mark.mlx
@pytest.mark.parametrize("variant", FAMILIES)
def test_sigkill_on_torch_then_mlx_within_the_bound_and_on_mlx_then_mlx_exactly(
    variant, tmp_path, tmp_path_factory, tiny_models
):
    load_engine("mlx")  # skips, saying how to install it, where MLX is missing
    fam = family(variant, tmp_path_factory, tiny_models)
    mlx = str(tmp_path / "clean-mlx")
    mlx_span = timed(fam.argv(mlx, "mlx"), fam.env, mlx)
    clean = {"torch": fam.clean, "mlx": Run.read(mlx)}

    state, committed, note = kill_after_first_commit(fam, tmp_path, f"{variant}-mlx")
    done = kit.run_tune(fam.argv(state, "mlx"), fam.env)
    assert done.returncode == 0, done.stderr
    assert kit.resumed_from(done.stderr, STEPS, ACCUM) == committed
    doc = kit.state_json(state, STEPS)
    ranges = [(p["from_step"], p["to_step"], p["engine"]) for p in doc["producers"]]
    assert ranges == [(0, committed, "torch"), (committed, STEPS, "mlx")]
    moved = Run.read(state)
    assert moved.losses[:committed] == fam.clean.losses[:committed]
    pinned_loss, pinned_params = D[0.0][0], PARAMS.get(variant, D[0.0][1])
    pair = (
        loss_distance(clean["torch"].losses, clean["mlx"].losses),
        param_distance(clean["torch"].params, clean["mlx"].params),
    )
    assert pair[0] <= pinned_loss and pair[1] <= pinned_params, (pair, pinned_params)
    lines = [note, f"clean pair: losses {pair[0]:.3g}, params {pair[1]:.3g}"]
    for engine, run in clean.items():
        dl, dp = loss_distance(moved.losses, run.losses), param_distance(moved.params, run.params)
        lines.append(f"vs clean {engine}: losses {dl:.3g}, params {dp:.3g}")
        assert dl <= FACTOR * pinned_loss + EPS, (engine, dl)
        assert dp <= FACTOR * pinned_params + EPS, (engine, dp)
    print(f"\n{variant}: " + "; ".join(lines))
    assert kit.litter(state) == []

    # killed on MLX and finished on MLX: the uninterrupted MLX run exactly
    state, committed, note = kill_after_first_commit(
        fam, tmp_path, variant, "mlx", clean["mlx"], mlx_span
    )
    done = kit.run_tune(fam.argv(state, "mlx"), fam.env)
    assert done.returncode == 0, done.stderr
    assert kit.resumed_from(done.stderr, STEPS, ACCUM) == committed
    kit.assert_same_checkpoint(state, mlx, STEPS, ACCUM)
    assert kit.adapter_files(state) == kit.adapter_files(mlx)
    assert kit.litter(state) == []
    print(f"{variant} on MLX: {note}, finished on MLX as the uninterrupted MLX run")
