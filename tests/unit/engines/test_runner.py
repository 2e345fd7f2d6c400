"""The core runner on every engine: streamed == resident bit for bit (float32 and bf16),
a row's log-probs the same bits in any batch, sharded loading, seeded sampling that ignores batch neighbours, stop ids, adapters, the ring
sized from memory and really streaming."""

from __future__ import annotations

import numpy as np
import pytest

from spill.engines.base import GenerateParams
from spill.engines.core.budget import resident_bytes
from spill.errors import EngineError
from spill.models.config import load_config
from spill.models.lora import LoraConfig, init_params
from spill.models.sources.tiny import write_tiny
from tests.unit.engines.kit import (
    COMPLETIONS,
    GREEDY,
    PROMPTS,
    SAMPLED,
    nudged,
    open_runner,
    same,
    tokens,
)


@pytest.fixture
def runners(engine, tiny_model):
    """(streamed with a ring of 2, resident), both float32."""
    streamed = open_runner(engine, tiny_model, ring=2, dtype="float32")
    resident = open_runner(engine, tiny_model, resident=True, dtype="float32")
    yield streamed, resident
    streamed.close()
    resident.close()


def test_streamed_and_resident_are_bit_identical(runners):
    streamed, resident = runners
    assert not streamed.info.resident and streamed.info.ring == 2
    assert resident.info.resident
    a, b = streamed.score(PROMPTS, COMPLETIONS), resident.score(PROMPTS, COMPLETIONS)
    assert all(x.dtype == np.float32 for x in a) and same(a, b)
    seeds = [1, 2, 3]
    for params in (GREEDY, SAMPLED):
        a, b = streamed.generate(PROMPTS, params, seeds), resident.generate(PROMPTS, params, seeds)
        assert tokens(a) == tokens(b)
    assert streamed.stats.extra["ring_max_live"] <= 2


def test_a_rows_log_probs_are_the_same_bits_in_any_batch(runners):
    """Scoring runs every row alone at its own length inside the shared walk, so a row's
    log-probs equal what it gets alone, beside longer and shorter rows, in batches of 2, 7 and
    all, in another order, streamed and resident (padded together they moved by up to 3e-5)."""
    streamed, resident = runners
    rng = np.random.default_rng(0)
    vocab = streamed.model.cfg.vocab_size
    prompts = [rng.integers(0, vocab, n) for n in rng.integers(1, 40, 20)]
    completions = [rng.integers(0, vocab, n) for n in rng.integers(0, 9, 20)]
    alone = [streamed.score([p], [c])[0] for p, c in zip(prompts, completions, strict=True)]
    assert any(len(a) for a in alone)
    for runner in (streamed, resident):
        for size in (2, 7, 20):
            got = []
            for i in range(0, 20, size):
                got += runner.score(prompts[i : i + size], completions[i : i + size])
            assert same(got, alone)
        backwards = runner.score(prompts[::-1], completions[::-1])[::-1]
        assert same(backwards, alone)


def test_bfloat16_streamed_and_resident_are_bit_identical(engine, tiny_models):
    folder = tiny_models["qwen2"]
    streamed = open_runner(engine, folder, ring=2, dtype="bfloat16")
    resident = open_runner(engine, folder, resident=True, dtype="bfloat16")
    assert streamed.info.numerics == "bfloat16"
    assert str(streamed.model.kernel.embed.dtype).endswith("bfloat16")
    a = streamed.score(PROMPTS, COMPLETIONS)
    assert same(a, resident.score(PROMPTS, COMPLETIONS))
    ref = open_runner(engine, folder, dtype="float32").score(PROMPTS, COMPLETIONS)
    assert max(np.abs(x - y).max() for x, y in zip(a, ref, strict=True)) < 0.1


def test_sharded_model_equals_single_file(engine, tiny_model, tmp_path):
    family = load_config(tiny_model).family
    sharded = write_tiny(tmp_path / "sharded", family=family, seed=7, shards=3)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    a = open_runner(engine, sharded, ring=2, dtype="float32").score(PROMPTS, COMPLETIONS)
    b = open_runner(engine, tiny_model, ring=2, dtype="float32").score(PROMPTS, COMPLETIONS)
    assert same(a, b)


def test_seeded_sampling_is_reproducible_and_ignores_batch_neighbours(runners):
    streamed, _ = runners
    seeds = [11, 12, 13]
    batch = streamed.generate(PROMPTS, SAMPLED, seeds)
    assert tokens(batch) == tokens(streamed.generate(PROMPTS, SAMPLED, seeds))
    for prompt, seed, in_batch in zip(PROMPTS, seeds, batch, strict=True):
        assert tokens(streamed.generate([prompt], SAMPLED, [seed])) == tokens([in_batch])
    outs = {tuple(streamed.generate([PROMPTS[0]], SAMPLED, [s])[0].tokens) for s in range(4)}
    assert len(outs) > 1  # the seed matters
    # Left padding changes tensor shapes, so a padded row's log-probs are close, not bit-equal.
    together = streamed.score(PROMPTS, COMPLETIONS)
    for prompt, completion, got in zip(PROMPTS, COMPLETIONS, together, strict=True):
        np.testing.assert_allclose(got, streamed.score([prompt], [completion])[0], atol=1e-5)


def test_stop_ids_finish_rows_independently(runners):
    streamed, _ = runners
    free = streamed.generate(PROMPTS, GREEDY, [0, 0, 0])
    assert all(g.finish == "length" and len(g.tokens) == 12 for g in free)
    first = int(free[1].tokens[0])
    stopped = streamed.generate(
        PROMPTS, GenerateParams(max_new_tokens=12, stop_ids=(first,)), [0] * 3
    )
    assert stopped[1].finish == "stop" and len(stopped[1].tokens) == 0
    for g, f in zip(stopped, free, strict=True):
        at = f.tokens.tolist().index(first) if first in f.tokens else None
        want = (f.tokens.tolist(), "length") if at is None else (f.tokens[:at].tolist(), "stop")
        assert (g.tokens.tolist(), g.finish) == want


def test_on_token_streams_each_token_in_order_and_can_end_a_row(runners):
    streamed, _ = runners
    free = streamed.generate(PROMPTS, GREEDY, [0, 0, 0])
    seen: list[tuple[int, int]] = []
    streamed_out = streamed.generate(
        PROMPTS, GREEDY, [0, 0, 0], on_token=lambda r, t: seen.append((r, t))
    )
    assert tokens(streamed_out) == tokens(free)  # watching changes nothing
    for r, g in enumerate(free):
        assert [t for row, t in seen if row == r] == g.tokens.tolist()
    # row 1 asks to stop after its third token; its neighbours are unaffected
    counts = {0: 0, 1: 0, 2: 0}

    def stop_row_1(r: int, t: int) -> bool:
        counts[r] += 1
        return r == 1 and counts[r] == 3

    ended = streamed.generate(PROMPTS, GREEDY, [0, 0, 0], on_token=stop_row_1)
    assert (
        ended[1].finish == "cancelled" and ended[1].tokens.tolist() == free[1].tokens[:3].tolist()
    )
    assert [tokens([ended[i]]) for i in (0, 2)] == [tokens([free[i]]) for i in (0, 2)]


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
    with pytest.raises(EngineError, match="token ids"):
        streamed.score([np.array([1, 999])], [np.array([1])])


def test_use_adapter_changes_scores_and_none_restores_the_base(runners, tiny_model):
    runner, resident = runners
    cfg = load_config(tiny_model)
    lora = LoraConfig(rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"))
    prompts, completions = PROMPTS[:2], COMPLETIONS[:2]
    base = runner.score(prompts, completions)
    runner.use_adapter(lora, init_params(cfg, lora, 3))  # B = 0: exactly the base model
    assert same(base, runner.score(prompts, completions))
    params = nudged(cfg, lora)
    runner.use_adapter(lora, params)
    tuned = runner.score(prompts, completions)
    assert not any(np.allclose(a, b) for a, b in zip(base, tuned, strict=True))
    params[next(iter(params))][:] = 7.0  # the runner holds its own copy
    assert same(tuned, runner.score(prompts, completions))
    resident.use_adapter(lora, nudged(cfg, lora))  # streamed == resident with an adapter too
    assert same(tuned, resident.score(prompts, completions))
    greedy = GenerateParams(max_new_tokens=6)
    a, b = runner.generate(prompts, greedy, [0, 0]), resident.generate(prompts, greedy, [0, 0])
    assert tokens(a) == tokens(b)
    runner.use_adapter(None, None)
    assert same(base, runner.score(prompts, completions))


def test_use_adapter_rejects_other_shapes(engine, tiny_models):
    folder = tiny_models["llama"]
    runner = open_runner(engine, folder, ring=2, dtype="float32")
    params = init_params(load_config(folder), LoraConfig(rank=4, targets=("q_proj",)), 0)
    with pytest.raises(EngineError, match="missing"):
        runner.use_adapter(LoraConfig(rank=4, targets=("q_proj", "k_proj")), params)
    with pytest.raises(EngineError, match="shape"):
        runner.use_adapter(LoraConfig(rank=2, targets=("q_proj",)), params)
    runner.close()


def test_engine_sizes_the_ring_from_memory(engine, tiny_models):
    folder = tiny_models["llama"]
    cfg = load_config(folder)
    layer_bytes = cfg.layer_params() * 4
    head = resident_bytes(cfg, 4)  # --memory holds the resident parts too (core.budget)

    def info(**kw):
        runner = open_runner(engine, folder, dtype="float32", **kw)
        runner.close()
        return runner.info

    assert info(memory=head + layer_bytes * cfg.num_hidden_layers).resident
    tight = info(memory=head + layer_bytes * 3 + 1)
    assert (tight.resident, tight.ring) == (False, 3)
    assert info(memory=head + layer_bytes * 2).ring == 2
    with pytest.raises(EngineError, match=r"cannot hold .* use --memory \d+MiB or more"):
        info(memory=head + layer_bytes * 2 - 1)  # the smallest plan: two slots
    assert info(ring=2, memory=10**12).ring == 2
    assert info().resident  # the default budget (half the free RAM) holds a tiny model
    assert "streaming, ring 3 of 4 layers" in tight.line()


def test_streaming_generation_reloads_every_layer_each_step(engine, tiny_models):
    runner = open_runner(engine, tiny_models["qwen2"], ring=2, dtype="float32")
    runner.generate([np.array([1, 2, 3])], GenerateParams(max_new_tokens=5), [0])
    assert runner.stats.layer_loads == 5 * runner.info.layers  # prefill + 4 decode steps
    assert runner.stats.extra["ring_max_live"] == 2
    assert runner.stats.load_seconds > 0
    runner.close()


def test_finished_rows_leave_the_batch_and_the_rest_decode_as_before(runners, monkeypatch):
    """Rows stop at different steps; once a quarter of the batch has finished, the finished rows
    are dropped from the KV caches (``keep_rows``) and the others decode on. Every row's tokens
    and finish equal what it makes alone, greedy and sampled, streamed and resident alike."""
    streamed, resident = runners
    prompts = [np.array([(i * 7 + j) % 60 + 1 for j in range(2 + i % 4)]) for i in range(8)]
    seeds = list(range(8))
    free = streamed.generate(prompts, GREEDY, seeds)
    stop: set[int] = set()  # tokens some rows make early, none that two rows never make
    for i, g in enumerate(free):
        more = stop | {int(g.tokens[1 + i % 5])}
        if sum(not set(f.tokens.tolist()) & more for f in free) >= 2:
            stop = more
    assert len(stop) >= 2
    calls = []
    for runner in (streamed, resident):
        kernel = runner.model.kernel
        keep = kernel.keep_rows
        monkeypatch.setattr(
            kernel, "keep_rows", lambda c, r, keep=keep: calls.append(len(r)) or keep(c, r)
        )
    greedy = GenerateParams(max_new_tokens=12, stop_ids=tuple(stop))
    sampled = GenerateParams(max_new_tokens=12, stop_ids=tuple(stop), temperature=0.9, top_p=0.95)
    for params in (greedy, sampled):
        calls.clear()
        batch = streamed.generate(prompts, params, seeds)
        if params is greedy:
            assert calls and calls[0] < 8, "no row ever left the batch"
            assert {g.finish for g in batch} == {"stop", "length"}
        alone = [
            streamed.generate([p], params, [s])[0] for p, s in zip(prompts, seeds, strict=True)
        ]
        assert [(g.tokens.tolist(), g.finish) for g in batch] == [
            (g.tokens.tolist(), g.finish) for g in alone
        ]
        assert tokens(batch) == tokens(resident.generate(prompts, params, seeds))
