"""``spill tune`` through the real CLI: the finished run's checkpoint and adapter tree, the PEFT
export, exact resume in a fresh process (locally and on S3), streamed vs resident, and the
one-line refusals to continue a checkpoint made with other settings.

"Exact" means what the spec promises for the same engine, device and library versions: every
adapter and AdamW tensor ``np.array_equal``, the losses and the cursor equal, and the COMMIT file
byte for byte equal (so the sha256 of each checkpoint file is the control's).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from spill.control.place import Place
from spill.jobs.tune.data import data_fingerprint
from spill.models.sources.tiny import write_tiny
from spill.models.weights import fingerprint
from spill.payloads.checkpoint import COMMIT, PARAMS, latest_checkpoint
from spill.store.location import location
from tests.func import tune_kit as kit

ADAPTER_TREE = {
    "README.md",
    "adapter.json",
    "loss.png",
    "params.safetensors",
    "peft/adapter_config.json",
    "peft/adapter_model.safetensors",
    "mlx/adapter_config.json",
    "mlx/adapters.safetensors",
}


@pytest.fixture(scope="module")
def control(tmp_path_factory, tiny_models) -> kit.Control:
    return kit.control(tmp_path_factory, tiny_models)


def test_a_finished_run_commits_its_checkpoint_and_writes_the_adapter_tree(control):
    assert "streaming, ring 2 of 4 layers" in control.stderr
    assert "adapter written to" in control.stderr
    assert kit.committed_steps(control.state) == [4, 6]  # every 2 steps, the two newest kept
    assert kit.litter(control.state) == []
    state = kit.state_json(control.state, kit.STEPS)
    assert state["step"] == kit.STEPS and state["cursor"] == kit.STEPS * kit.ACCUM
    assert len(state["losses"]) == kit.STEPS and all(np.isfinite(state["losses"]))
    [producer] = state["producers"]  # one machine made every step
    assert (producer["from_step"], producer["to_step"]) == (0, kit.STEPS)
    assert producer["engine"] == "torch" and producer["numerics"] == "float32"

    tree = kit.adapter_files(control.state)
    assert set(tree) == ADAPTER_TREE
    png = tree["loss.png"]
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert width >= 200 and height >= 100 and png[-8:-4] == b"IEND"
    meta = json.loads(tree["adapter.json"])
    assert meta["steps"] == kit.STEPS and meta["lora"]["rank"] == kit.SETTINGS["rank"]
    assert meta["fingerprint"] == fingerprint(control.model)
    # the published adapter is the final checkpoint's
    final = kit.tensors(kit.files(control.state, kit.STEPS)[PARAMS])
    published = kit.tensors(tree["params.safetensors"])
    assert sorted(published) == sorted(final)
    assert all(np.array_equal(published[k], final[k]) for k in final)
    assert any(np.abs(final[k]).max() > 0 for k in final if k.endswith("lora_b"))  # it trained


def test_the_peft_export_loads_in_peft_and_changes_the_model(control):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    folder = str(control.model)
    peft_dir = f"{control.state}/adapter/peft"

    def base():
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    tuned = peft.PeftModel.from_pretrained(base(), peft_dir).eval()
    ours = kit.tensors(kit.files(control.state, kit.STEPS)[PARAMS])
    loaded = {k: v.detach().numpy() for k, v in tuned.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(ours)
    for name, value in ours.items():
        stem, ab = name.rsplit(".", 1)
        key = f"base_model.model.model.{stem}.lora_{ab[-1].upper()}.default.weight"
        assert np.array_equal(loaded[key], value.T), key
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 8]])
    with torch.no_grad():
        diff = (tuned(ids).logits - base()(ids).logits).abs().max().item()
    assert diff > 1e-4


def test_stop_after_then_the_same_command_continues_exactly(control, tmp_path):
    state = str(tmp_path / "state")
    env = kit.spill_env(tmp_path / "home")
    first = kit.run_tune(kit.tune_argv(control.model, control.train, state, stop_after=3), env)
    assert first.returncode == 0, first.stderr
    assert (
        "stopped after step 3 of 6 (--stop-after) with a committed checkpoint; to continue, run it again without --stop-after or with a later one"
        in first.stderr
    )
    assert kit.committed_steps(state) == [2, 3]  # every 2 steps, and at the stop
    assert "adapter" not in kit.fs.listdir(state)
    partial = kit.state_json(state, 3)
    assert partial["losses"] == control.losses[:3] and partial["cursor"] == 3 * kit.ACCUM

    again = kit.run_tune(kit.tune_argv(control.model, control.train, state), env)  # fresh process
    assert again.returncode == 0, again.stderr
    assert kit.resumed_from(again.stderr) == 3
    kit.assert_same_checkpoint(state, control.state)
    assert kit.adapter_files(state) == kit.adapter_files(control.state)
    assert kit.litter(state) == []


@pytest.mark.parametrize(
    "over, line",
    [
        ({"resident": True}, "activations kept (est."),
        ({"resident": True, "activations": "recompute"}, "recomputed (--activations recompute;"),
        ({"activations": "recompute"}, "recomputed (--activations recompute;"),
        ({"activations": "keep"}, "recomputed (layers stream;"),
    ],
    ids=["resident-kept", "resident-recompute", "ring-recompute", "ring-keep-streams"],
)
def test_streamed_and_resident_runs_give_identical_checkpoints(control, tmp_path, over, line):
    """The control streams (ring 2) and reuses its forward's gate/up outputs in the recompute;
    kept activations, a full recompute and a refused keep give the very same checkpoint."""
    state = str(tmp_path / "state")
    argv = kit.tune_argv(control.model, control.train, state, ckpt_every=3, **over)
    done = kit.run_tune(argv, kit.spill_env(tmp_path / "home"))
    assert done.returncode == 0, done.stderr
    resident = "resident" in over
    assert ("· resident" in done.stderr) == resident and ("ring" in done.stderr) != resident
    assert line in done.stderr
    kit.assert_same_checkpoint(state, control.state)
    assert kit.adapter_files(state) == kit.adapter_files(control.state)


def test_an_s3_state_stops_and_continues_in_a_fresh_process_exactly(control, s3_bucket, tmp_path):
    state = f"s3://{s3_bucket}/x"
    env = kit.spill_env(tmp_path / "home")  # carries AWS_ENDPOINT_URL and the test credentials
    first = kit.run_tune(kit.tune_argv(control.model, control.train, state, stop_after=3), env)
    assert first.returncode == 0, first.stderr
    assert kit.committed_steps(state) == [2, 3]
    again = kit.run_tune(kit.tune_argv(control.model, control.train, state), env)
    assert again.returncode == 0, again.stderr
    assert kit.resumed_from(again.stderr) == 3
    kit.assert_same_checkpoint(state, control.state)
    assert kit.committed_steps(state) == [4, 6] and kit.litter(state) == []
    assert kit.adapter_files(state) == kit.adapter_files(control.state)


# --- refusals ---------------------------------------------------------------------------------

REFUSALS = ["lr", "steps", "seed", "batch", "micro_batch", "training file", "model"]


@pytest.fixture(scope="module")
def refusals(control, tmp_path_factory):
    """A run stopped at step 1, then every changed command against a copy of its state, at once.

    Returns ``what: (CompletedProcess, expected text, state, files of step 1 before)``.
    """
    base = tmp_path_factory.mktemp("refusals")
    env = kit.spill_env(base / "home")
    state = str(base / "state")
    first = kit.run_tune(kit.tune_argv(control.model, control.train, state, stop_after=1), env)
    assert first.returncode == 0, first.stderr

    other_train = kit.write_train((base / "other").joinpath("train.jsonl"), salt="!")
    other_model = write_tiny(base / "other-model", family="llama", seed=8)
    theirs_fp, ours_fp = fingerprint(control.model), fingerprint(other_model)
    theirs_data, ours_data = data_fingerprint(control.train), data_fingerprint(other_train)
    cases = {
        "lr": ({"lr": 0.02}, "learning rate 0.01, this run has 0.02"),
        "steps": ({"steps": 8}, "total steps (--steps) 6, this run has 8"),
        "seed": ({"seed": 4}, "seed 3, this run has 4"),
        "batch": ({"batch": 8}, "batch 4, this run has 8"),
        "micro_batch": ({"micro_batch": 1}, "micro batch 2, this run has 1"),
        "training file": ({}, f"training file {theirs_data!r}, this run has {ours_data!r}"),
        "model": ({}, f"weights (fingerprint) {theirs_fp!r}, this run has {ours_fp!r}"),
    }
    assert set(cases) == set(REFUSALS)
    jobs, expected = {}, {}
    for what, (change, text) in cases.items():
        copy = str(base / f"state-{what.replace(' ', '-')}")
        shutil.copytree(state, copy)
        model = other_model if what == "model" else control.model
        train = other_train if what == "training file" else control.train
        jobs[what] = (kit.tune_argv(model, train, copy, **change), env)
        expected[what] = (text, copy, kit.files(copy, 1))
    done = kit.run_concurrently(jobs)
    return {what: (done[what], *expected[what]) for what in cases}


@pytest.mark.parametrize("what", REFUSALS)
def test_continuing_with_other_settings_is_refused_in_one_line(refusals, what):
    proc, text, state, before = refusals[what]
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.splitlines()
    errors = [line for line in lines if line.startswith("spill: error:")]
    assert len(errors) == 1, proc.stderr
    # the pre-run line (model, engine, numerics) comes first: the model loads before the check
    assert [line for line in lines if line not in errors] == [
        line for line in lines if line.startswith(kit.PRE_RUN)
    ]
    assert len(lines) <= 2, proc.stderr
    error = errors[0]
    assert f"{kit.step_dir(state, 1)} was made with {text};" in error, error
    assert "another --state" in error
    assert proc.stdout == ""
    assert kit.step_dirs(state) == ["ckpt-g1-s1-0"] and kit.files(state, 1) == before  # untouched


def test_spill_tune_with_no_setting_flags_makes_a_default_builds_checkpoint(tmp_path, spill_home):
    """One definition per setting: the toy build with every tune setting at its conf default,
    stopped after step 1, and a plain ``spill tune`` (no setting flags) on the same split are one
    run: its step-1 checkpoint is the build's, COMMIT for COMMIT (so every file's sha256).

    The build's stage state is the build's run's to write: ``spill tune --state`` inside it is
    refused in one line (its own run would collect the build's checkpoint folders, which share
    their names) and the build's checkpoint stays current."""
    from spill.conf import defaults

    from tests.conftest import run_spill

    root = Path(__file__).resolve().parents[2]
    toy = shutil.copytree(root / "projects" / "toy", tmp_path / "toy")
    shutil.rmtree(toy / ".spill", ignore_errors=True)
    back = [f"tune.{k}={json.dumps(v)}" for k, v in defaults("tune").items()]  # null, "a,b"
    build = run_spill("build", str(toy), "--stop-after", "tune:1", *back)
    assert build.returncode == 0, build.stderr
    state = toy / ".spill"
    made = latest_checkpoint(Place(location(state), "stages/tune"))
    assert made is not None and made.step == 1
    argv = ["tune", "tiny:llama:2:2x64", str(state / "files" / "train.jsonl"), "--name", "toy"]
    argv += ["--stop-after", "1", "--dtype", "float32"]

    inside = run_spill(*argv, "--state", str(state / "stages" / "tune"))
    assert inside.returncode == 1, inside.stderr
    [error] = inside.stderr.splitlines()
    assert error.startswith("spill: error:") and f"lies inside {state}" in error, error
    again = latest_checkpoint(Place(location(state), "stages/tune"))
    assert again is not None and again.uri == made.uri  # still current, and it verifies

    solo = str(tmp_path / "solo")
    proc = run_spill(*argv, "--state", solo)
    assert proc.returncode == 0, proc.stderr
    assert "stopped after step 1 of 100" in proc.stderr, proc.stderr
    assert kit.files(solo, 1)[COMMIT] == kit.fs.get_bytes(kit.fs.join(made.uri, COMMIT))
