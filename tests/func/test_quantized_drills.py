"""Kill drills for ``spill tune`` on a quantized base: the tiny llama's 4-bit group-32 copy.

The same promise as ``test_tune_drills`` (the rerun's final checkpoint, adapter and losses equal
the uninterrupted control's exactly, nothing a dead writer left survives), with the control made
on the packed folder. The boundaries picked are one of each kind: mid-step, a checkpoint's COMMIT
not yet put, the last checkpoint published, the adapter's publication; then the COMMIT boundary
on an S3 state and four random moments (two pairs, as the float drills run them).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.func import test_tune_drills as drills
from tests.func import tune_kit as kit


@pytest.fixture(scope="module")
def control(tmp_path_factory, tiny_models) -> kit.Control:
    return kit.control(tmp_path_factory, tiny_models, variant="quantized")


def test_the_quantized_control_runs_on_the_packed_folder(control, tiny_models, tmp_path_factory):
    assert "weights 4-bit affine g32" in control.stderr  # the pre-run line names the format
    float_run = kit.control(tmp_path_factory, tiny_models)
    assert control.losses != float_run.losses  # another base: another trajectory


PICKED = [
    "tune-after-backward@4",
    "ckpt-before-commit@2",
    "ckpt-after-commit@3",
    "put-before-rename@5",
]
BOUNDARIES = [b for b in drills.BOUNDARIES if b[0] in PICKED]


@pytest.mark.parametrize("drill, committed, left", BOUNDARIES, ids=[b[0] for b in BOUNDARIES])
def test_sigkill_at_a_named_boundary_on_a_quantized_base(control, tmp_path, drill, committed, left):
    state = str(tmp_path / "state")
    env = kit.spill_env(tmp_path / "home")
    killed = kit.run_tune(
        kit.tune_argv(control.model, control.train, state), {**env, "SPILL_DRILL": drill}
    )
    drills.assert_killed(killed)
    assert kit.latest_step(state) == committed
    drills.assert_on_track(state, control, committed)
    found = kit.litter(state)
    assert len(found) == len(left) and all(
        any(f.startswith(prefix) for f in found) for prefix in left
    ), found
    drills.finish(state, control, env, committed)


def test_sigkill_before_commit_on_s3_on_a_quantized_base(control, s3_bucket, tmp_path):
    state = f"s3://{s3_bucket}/job"
    env = kit.spill_env(tmp_path / "home")
    killed = kit.run_tune(
        kit.tune_argv(control.model, control.train, state),
        {**env, "SPILL_DRILL": "ckpt-before-commit@2"},
    )
    drills.assert_killed(killed)
    assert kit.latest_step(state) == 2
    assert kit.litter(state) == ["payloads/ckpt-g1-s4-0 (not current)"]
    drills.finish(state, control, env, 2)


@pytest.mark.parametrize("pair", drills.PAIRS[:2], ids=lambda p: f"{p[0]}+{p[1]}")
def test_sigkill_at_random_moments_on_a_quantized_base(control, tmp_path, pair):
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {
            i: pool.submit(drills._random_kill, control, tmp_path / f"case-{i}", i) for i in pair
        }
    for i, run in runs.items():
        try:
            run.result()
        except Exception as e:
            raise AssertionError(f"random kill case {drills._label(i)} failed") from e
