"""``spill tune --lr`` past what AdamW can step (3e38 gave a traceback: "value cannot be
converted to type float without overflow"), not a number, or not above 0: one line naming
--lr, exit 2, before any model is resolved or state written."""

from __future__ import annotations

import pytest

from spill.ground.paths import models_dir
from tests.conftest import run_spill
from tests.func import tune_kit as kit
from tests.func.test_model_integrity import one_error


@pytest.mark.parametrize("lr", ["3e38", "1e300", "nan", "inf", "-1", "0"])
def test_an_absurd_lr_is_refused_in_one_line(tmp_path, lr):
    train = kit.write_train(tmp_path / "train.jsonl")
    state = tmp_path / "state"
    argv = ["tune", "tiny:llama:1", str(train), "--name", "x", "--state", str(state)]
    proc = run_spill(*argv, f"--lr={lr}", "--steps", "2")
    assert proc.returncode == 2, proc.stderr
    error = one_error(proc)
    assert (
        error.startswith("spill: error: --lr ") and "a learning rate is a number above 0" in error
    )
    assert not state.exists()
    assert not models_dir().exists() or not any(models_dir().iterdir())  # nothing resolved


def test_the_largest_lr_allowed_steps_without_a_traceback(tmp_path):
    """1e37 is allowed (AdamW's first step stays within float32); the loss then stops being
    finite and the tune stops in one line, as any diverging tune does."""
    train = kit.write_train(tmp_path / "train.jsonl")
    argv = kit.tune_argv("tiny:llama:1", train, str(tmp_path / "state"), lr=1e37, steps=3)
    proc = run_spill(*argv, timeout=kit.TIMEOUT)
    assert "Traceback" not in proc.stderr and proc.returncode in (0, 1), proc.stderr
    if proc.returncode == 1:
        assert "the loss is" in one_error(proc)
