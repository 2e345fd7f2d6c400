"""The torch engine against transformers (log-probs, greedy, Llama 3 rope scaling), and CUDA
streaming like the CPU. What every engine must do is in ``test_runner.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spill.engines.base import GenerateParams
from spill.engines.torch import ENGINE
from tests.unit.engines import kit
from tests.unit.engines.kit import COMPLETIONS, GREEDY, PROMPTS, llama3_scaled


def open_runner(folder, **options):
    return kit.open_runner(ENGINE, folder, **options)


@pytest.fixture
def streamed(tiny_model):
    """A float32 runner streaming through a ring of 2."""
    runner = open_runner(tiny_model, ring=2, dtype="float32")
    yield runner
    runner.close()


def hf_log_probs(model, prompt, completion):
    ids = torch.tensor(np.concatenate([prompt, completion]))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]  # (T, V)
    return logp[len(prompt) - 1 : -1].gather(1, ids[0, len(prompt) :, None])[:, 0].numpy()


def hf_model(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_log_probs_match_transformers(streamed, tiny_model):
    hf = hf_model(tiny_model)
    ours = streamed.score(PROMPTS, COMPLETIONS)  # batched, left-padded
    for prompt, completion, got in zip(PROMPTS, COMPLETIONS, ours, strict=True):
        ref = hf_log_probs(hf, prompt, completion)
        assert np.abs(got - ref).max() <= 1e-5
        alone = streamed.score([prompt], [completion])[0]
        assert np.abs(alone - ref).max() <= 1e-5


def test_greedy_matches_transformers(streamed, tiny_model):
    hf = hf_model(tiny_model)
    stop = tuple(hf.generation_config.eos_token_id)
    for prompt in (PROMPTS[0], PROMPTS[2]):
        ours = streamed.generate([prompt], GenerateParams(max_new_tokens=12, stop_ids=stop), [0])[0]
        out = hf.generate(torch.tensor(prompt)[None], do_sample=False, max_new_tokens=12)
        theirs = out[0, len(prompt) :].tolist()
        n = len(ours.tokens)
        assert ours.tokens.tolist() == theirs[:n]
        if ours.finish == "stop":
            assert theirs[n] in stop
        else:
            assert n == 12 == len(theirs)


def test_llama3_rope_scaling_matches_transformers(tiny_models, tmp_path):
    folder = llama3_scaled(tiny_models["llama"], tmp_path / "llama3")
    runner = open_runner(folder, dtype="float32")
    prompt, completion = np.arange(30, 90), np.arange(90, 120)
    ref = hf_log_probs(hf_model(folder), prompt, completion)
    assert np.abs(runner.score([prompt], [completion])[0] - ref).max() <= 1e-5
    plain = open_runner(tiny_models["llama"], dtype="float32").score([prompt], [completion])[0]
    assert not np.allclose(plain, ref)  # the scaling really changed something


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_streams_like_the_cpu(tiny_models):
    folder = tiny_models["qwen2"]
    assert open_runner(folder, device="cuda").info.why == "CUDA"
    streamed = open_runner(folder, device="cuda", ring=2, dtype="float32")
    resident = open_runner(folder, device="cuda", resident=True, dtype="float32")
    cpu = open_runner(folder, device="cpu", dtype="float32")
    a, b = streamed.score(PROMPTS, COMPLETIONS), resident.score(PROMPTS, COMPLETIONS)
    for x, y, z in zip(a, b, cpu.score(PROMPTS, COMPLETIONS), strict=True):
        assert np.array_equal(x, y)
        np.testing.assert_allclose(x, z, atol=1e-4)
    g = streamed.generate(PROMPTS, GREEDY, [0, 1, 2])
    assert [x.tokens.tolist() for x in g] == [
        x.tokens.tolist() for x in resident.generate(PROMPTS, GREEDY, [0, 1, 2])
    ]
