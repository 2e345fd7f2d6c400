"""Long work is not silent outside a terminal (issue 21, item 2): with stderr a pipe, as under
nohup, CI, Slurm or ``| tee``, a tune prints one plain line at a steady pace and at each
checkpoint; work shorter than the pace prints none."""

from __future__ import annotations

import re

from tests.func import tune_kit as kit

LINE = re.compile(r"^tune: step (\d+)/(\d+) \(\d+%\), loss [\d.]+, tok/s \d+, [\d.]+ s/step")


def test_a_tune_in_a_pipe_prints_steady_lines(tmp_path, tiny_models):
    train = kit.write_train(tmp_path / "train.jsonl")
    argv = kit.tune_argv(tiny_models["llama"], train, str(tmp_path / "s"), steps=30, ckpt_every=10)
    env = kit.spill_env(tmp_path / "home", SPILL_PROGRESS_EVERY="0")  # a line at every step
    done = kit.run_tune(argv, env)
    assert done.returncode == 0, done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("tune: step")]
    assert all(LINE.match(ln) for ln in lines), lines
    paced = [int(LINE.match(ln)[1]) for ln in lines if "checkpoint" not in ln]
    saved = [int(LINE.match(ln)[1]) for ln in lines if ln.endswith(", checkpoint committed")]
    assert paced == list(range(1, 31)) and saved == [10, 20, 30], lines
    quiet = kit.run_tune([*argv[:6], str(tmp_path / "q"), *argv[7:]], kit.spill_env(tmp_path / "h"))
    assert quiet.returncode == 0 and "tune: step" not in quiet.stderr  # 30 s pace, shorter work
