"""The torch runner: streamed == resident bit for bit, agreement with transformers, sharded
loading, seeded sampling that ignores batch neighbours, stop ids."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from spill.engines.base import GenerateParams, LoadOptions, ModelSpec
from spill.engines.torch import ENGINE
from spill.models.config import load_config
from spill.models.tiny import write_tiny

PROMPTS = [np.array([5, 6, 7, 8, 9, 10]), np.array([100, 3]), np.arange(20, 40)]
COMPLETIONS = [np.array([11, 12, 13]), np.array([4, 5, 6, 7]), np.array([1])]
GREEDY = GenerateParams(max_new_tokens=12)
SAMPLED = GenerateParams(max_new_tokens=24, temperature=1.0, top_p=0.9)


def open_runner(folder, **options):
    return ENGINE.open(ModelSpec(folder, load_config(folder)), LoadOptions(**options))


@pytest.fixture
def runners(tiny_model):
    """(streamed with a ring of 2, resident), both float32."""
    streamed = open_runner(tiny_model, ring=2, dtype="float32")
    resident = open_runner(tiny_model, resident=True, dtype="float32")
    yield streamed, resident
    streamed.close()
    resident.close()


def hf_log_probs(model, prompt, completion):
    ids = torch.tensor(np.concatenate([prompt, completion]))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float(), dim=-1)[0]  # (T, V)
    return logp[len(prompt) - 1 : -1].gather(1, ids[0, len(prompt) :, None])[:, 0].numpy()


def hf_model(folder):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_streamed_and_resident_are_bit_identical(runners):
    streamed, resident = runners
    assert not streamed.info.resident and streamed.info.ring == 2
    assert resident.info.resident
    for a, b in zip(
        streamed.score(PROMPTS, COMPLETIONS), resident.score(PROMPTS, COMPLETIONS), strict=True
    ):
        assert a.dtype == np.float32 and np.array_equal(a, b)
    seeds = [1, 2, 3]
    for params in (GREEDY, SAMPLED):
        a, b = streamed.generate(PROMPTS, params, seeds), resident.generate(PROMPTS, params, seeds)
        assert [g.tokens.tolist() for g in a] == [g.tokens.tolist() for g in b]
        assert [g.finish for g in a] == [g.finish for g in b]


def test_bfloat16_streamed_and_resident_are_bit_identical(tiny_models):
    folder = tiny_models["qwen2"]
    streamed = open_runner(folder, ring=2, dtype="bfloat16")
    resident = open_runner(folder, resident=True, dtype="bfloat16")
    assert streamed.info.numerics == "bfloat16"
    for a, b in zip(
        streamed.score(PROMPTS, COMPLETIONS), resident.score(PROMPTS, COMPLETIONS), strict=True
    ):
        assert np.array_equal(a, b)


def test_log_probs_match_transformers(runners, tiny_model):
    streamed, _ = runners
    hf = hf_model(tiny_model)
    ours = streamed.score(PROMPTS, COMPLETIONS)  # batched, left-padded
    for prompt, completion, got in zip(PROMPTS, COMPLETIONS, ours, strict=True):
        ref = hf_log_probs(hf, prompt, completion)
        assert np.abs(got - ref).max() <= 1e-5
        alone = streamed.score([prompt], [completion])[0]
        assert np.abs(alone - ref).max() <= 1e-5


def test_greedy_matches_transformers(runners, tiny_model):
    streamed, _ = runners
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
    folder = tmp_path / "llama3"
    shutil.copytree(tiny_models["llama"], folder)
    cfg = json.loads((folder / "config.json").read_text())
    # original context 64 puts the tiny head's frequencies in all three bands (kept, smoothed, scaled)
    cfg["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    runner = open_runner(folder, dtype="float32")
    prompt, completion = np.arange(30, 90), np.arange(90, 120)
    ref = hf_log_probs(hf_model(folder), prompt, completion)
    assert np.abs(runner.score([prompt], [completion])[0] - ref).max() <= 1e-5
    plain = open_runner(tiny_models["llama"], dtype="float32").score([prompt], [completion])[0]
    assert not np.allclose(plain, ref)  # the scaling really changed something


def test_sharded_model_equals_single_file(tiny_model, tmp_path):
    family = json.loads((tiny_model / "config.json").read_text())["model_type"]
    sharded = write_tiny(tmp_path / "sharded", family=family, seed=7, shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    a = open_runner(sharded, ring=2, dtype="float32").score(PROMPTS, COMPLETIONS)
    b = open_runner(tiny_model, ring=2, dtype="float32").score(PROMPTS, COMPLETIONS)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_seeded_sampling_is_reproducible_and_ignores_batch_neighbours(runners):
    streamed, _ = runners
    seeds = [11, 12, 13]
    batch = streamed.generate(PROMPTS, SAMPLED, seeds)
    again = streamed.generate(PROMPTS, SAMPLED, seeds)
    assert [g.tokens.tolist() for g in batch] == [g.tokens.tolist() for g in again]
    for prompt, seed, in_batch in zip(PROMPTS, seeds, batch, strict=True):
        alone = streamed.generate([prompt], SAMPLED, [seed])[0]
        assert alone.tokens.tolist() == in_batch.tokens.tolist()
    # Left padding changes tensor shapes, so a padded row's log-probs are close, not bit-equal.
    together = streamed.score(PROMPTS, COMPLETIONS)
    for prompt, completion, got in zip(PROMPTS, COMPLETIONS, together, strict=True):
        np.testing.assert_allclose(got, streamed.score([prompt], [completion])[0], atol=1e-5)


def test_seeds_change_samples(tiny_models):
    runner = open_runner(tiny_models["qwen2"], ring=2, dtype="float32")
    outs = {tuple(runner.generate([PROMPTS[0]], SAMPLED, [s])[0].tokens) for s in range(4)}
    assert len(outs) > 1


def test_stop_ids_finish_rows_independently(runners):
    streamed, _ = runners
    free = streamed.generate(PROMPTS, GREEDY, [0, 0, 0])
    assert all(g.finish == "length" and len(g.tokens) == 12 for g in free)
    first = int(free[1].tokens[0])
    stops = [g.tokens.tolist().index(first) if first in g.tokens else None for g in free]
    stopped = streamed.generate(
        PROMPTS, GenerateParams(max_new_tokens=12, stop_ids=(first,)), [0] * 3
    )
    assert stopped[1].finish == "stop" and len(stopped[1].tokens) == 0
    for g, f, at in zip(stopped, free, stops, strict=True):
        if at is None:
            assert g.finish == "length" and g.tokens.tolist() == f.tokens.tolist()
        else:
            assert g.finish == "stop" and g.tokens.tolist() == f.tokens[:at].tolist()


def test_edges_and_stats(runners):
    streamed, _ = runners
    before = streamed.stats.layer_loads
    assert streamed.score([np.array([1, 2])], [np.array([], dtype=np.int64)])[0].shape == (0,)
    out = streamed.generate([np.array([1, 2])], GenerateParams(max_new_tokens=0), [0])
    assert out[0].tokens.shape == (0,) and out[0].finish == "length"
    streamed.generate([np.array([1, 2])], GenerateParams(max_new_tokens=3), [0])
    layers = streamed.info.layers
    # score walks once; generate walks once per token it feeds (prefill + 2 steps)
    assert streamed.stats.layer_loads - before == layers + 3 * layers
    assert streamed.stats.extra["ring_max_live"] <= 2
    assert streamed.stats.generated_tokens == 3


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
