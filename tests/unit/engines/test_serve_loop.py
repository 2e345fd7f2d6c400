"""Continuous batching (``Runner.serve``) on every engine, float32: a request that joins a
running batch, at any step and beside rows on other adapters, generates what it generates
alone; echo log-probs are ``score``'s bits; cancelled and empty requests leave cleanly."""

from __future__ import annotations

import numpy as np
import pytest

from spill.engines.base import GenerateParams, Request
from spill.errors import EngineError
from spill.models.config import load_config
from spill.models.lora import LoraConfig
from tests.unit.engines.kit import nudged, open_runner

LORA = LoraConfig(rank=4, targets=("q_proj", "v_proj", "down_proj"))


@pytest.fixture
def runner(engine, tiny_model):
    r = open_runner(engine, tiny_model, ring=2, dtype="float32")
    cfg = load_config(tiny_model)
    r.add_adapter("a", LORA, nudged(cfg, LORA, 1))
    r.add_adapter("b", LORA, nudged(cfg, LORA, 2))
    yield r
    r.close()


def serve(runner, waves: dict[int, list[Request]]) -> int:
    """Serve ``waves`` (the requests that join at each step); returns the steps taken."""
    calls = [0]
    last = max(waves)

    def take(idle: bool):
        at = calls[0]
        calls[0] += 1
        if at > last:
            return None
        return waves.get(at, [])

    runner.serve(take)
    return calls[0]


def request(prompt, new=10, adapter=None, **kw) -> tuple[Request, list]:
    done: list = []
    params = GenerateParams(max_new_tokens=new, **kw)
    return Request(np.asarray(prompt, np.int64), params, adapter=adapter, on_done=done.append), done


def alone(runner, prompt, new=10, adapter=None, **kw):
    req, done = request(prompt, new, adapter, **kw)
    serve(runner, {0: [req]})
    (gen,) = done
    return gen.tokens.tolist(), gen.finish


PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 3], list(range(20, 40)), [7], list(range(50, 61))]


def test_requests_joining_a_running_batch_generate_what_they_do_alone(runner):
    """Rows join at steps 0, 2, 3 and 9, shorter and longer than the batch's columns (the
    caches shift right), on the base and two adapters, with their own lengths."""
    plan = [(0, 0, None, 12), (0, 1, "a", 6), (2, 2, "b", 9), (3, 3, None, 14), (9, 4, "a", 8)]
    waves: dict[int, list[Request]] = {}
    results = []
    for step, p, adapter, new in plan:
        req, done = request(PROMPTS[p], new, adapter)
        waves.setdefault(step, []).append(req)
        results.append(done)
    steps = serve(runner, waves)
    assert steps <= 9 + 8 + 2  # they ran side by side: one at a time takes 49 steps
    for (_, p, adapter, new), done in zip(plan, results, strict=True):
        assert len(done) == 1  # on_done once
        got = (done[0].tokens.tolist(), done[0].finish)
        assert got == alone(runner, PROMPTS[p], new, adapter), (p, adapter)


def test_rows_on_different_adapters_share_a_batch(runner, tiny_model):
    """One batch of base, a and b rows; each equals ``generate`` under its own adapter."""
    reqs = [request(PROMPTS[0], 10, name) for name in (None, "a", "b", "a")]
    serve(runner, {0: [r for r, _ in reqs]})
    got = [done[0].tokens.tolist() for _, done in reqs]
    cfg = load_config(tiny_model)
    params = GenerateParams(max_new_tokens=10)
    for seed, tokens in ((1, got[1]), (2, got[2])):
        runner.use_adapter(LORA, nudged(cfg, LORA, seed))
        assert runner.generate([np.asarray(PROMPTS[0])], params, [0])[0].tokens.tolist() == tokens
    runner.use_adapter(None, None)
    assert runner.generate([np.asarray(PROMPTS[0])], params, [0])[0].tokens.tolist() == got[0]
    assert got[1] == got[3] and len({tuple(t) for t in got[:3]}) == 3  # the adapters matter


def test_echo_gives_scores_bits_and_generated_tokens_their_log_probs(runner):
    prompt = np.asarray(PROMPTS[2], np.int64)
    seen, tokens = [], []
    req = Request(
        prompt,
        GenerateParams(max_new_tokens=6),
        adapter="a",
        logprobs=3,
        echo=True,
        on_prompt=seen.append,
        on_token=tokens.append,
    )
    serve(runner, {0: [req]})
    (echoed,) = seen
    assert [t.id for t in echoed] == prompt.tolist() and echoed[0].logprob is None
    cfg = runner.model.cfg
    runner.use_adapter(LORA, nudged(cfg, LORA, 1))
    (scored,) = runner.score([prompt[:1]], [prompt[1:]])
    assert np.array_equal(np.asarray([t.logprob for t in echoed[1:]], np.float32), scored)
    for t in echoed[1:]:
        assert len(t.top) == 3 and [lp for _, lp in t.top] == sorted(
            (lp for _, lp in t.top), reverse=True
        )
        assert t.logprob <= t.top[0][1] + 1e-5
        if t.id == t.top[0][0]:  # a greedy prompt token: its log-prob is the largest, exactly
            assert t.logprob == max(lp for _, lp in t.top)
    assert len(tokens) == 6
    for t in tokens:  # greedy: the chosen token is the likeliest
        assert t.top[0][0] == t.id and t.top[0][1] == t.logprob
    ids = [t.id for t in tokens]
    (again,) = runner.score([prompt], [np.asarray(ids)])
    np.testing.assert_allclose([t.logprob for t in tokens], again, atol=1e-4)


def test_cancelled_and_empty_requests_leave_the_batch_cleanly(runner):
    kept, kept_done = request(PROMPTS[0], 12)
    cut_done: list = []
    cut = Request(
        np.asarray(PROMPTS[1], np.int64),
        GenerateParams(max_new_tokens=12),
        on_token=lambda t, n=[0]: (n.__setitem__(0, n[0] + 1), n[0] >= 2)[1],
        on_done=cut_done.append,
    )
    echo_only, echo_done = request(PROMPTS[3], 0)
    serve(runner, {0: [kept, cut], 1: [echo_only]})
    assert [g.finish for g in cut_done] == ["cancelled"] and len(cut_done[0].tokens) == 2
    assert [(g.finish, len(g.tokens)) for g in echo_done] == [("length", 0)]
    assert (kept_done[0].tokens.tolist(), kept_done[0].finish) == alone(runner, PROMPTS[0], 12)


def test_an_unknown_adapter_is_refused(runner):
    req, _ = request(PROMPTS[0], 4, "nope")
    with pytest.raises(EngineError, match="no adapter named 'nope'"):
        serve(runner, {0: [req]})


def test_echo_marks_a_greedy_continuation_greedy(runner):
    """lm-eval's ``is_greedy``: each token of a greedy continuation, echoed, has the largest
    log-prob among the likeliest exactly."""
    prefix = np.asarray(PROMPTS[0], np.int64)
    (gen,) = runner.generate([prefix], GenerateParams(max_new_tokens=8), [0])
    seen: list = []
    req = Request(
        np.concatenate([prefix, gen.tokens]),
        GenerateParams(max_new_tokens=0),
        logprobs=2,
        echo=True,
        on_prompt=seen.append,
    )
    serve(runner, {0: [req]})
    for t in seen[0][len(prefix) :]:
        assert t.top[0][0] == t.id and t.logprob == max(lp for _, lp in t.top)


def test_rows_on_different_expert_adapters_share_a_batch(engine, tmp_path):
    """Qwen3-MoE with adapters on every expert: an expert computes the tokens routed to it from
    every row at once, so each row's adapter follows its tokens there; each row equals
    ``generate`` under its own adapter alone."""
    from spill.models.sources.tiny import write_tiny

    folder = write_tiny(tmp_path / "moe", family="qwen3_moe", seed=7)
    cfg = load_config(folder)
    lora = LoraConfig(rank=4, targets=("q_proj", "gate_proj", "up_proj", "down_proj"))
    r = open_runner(engine, folder, ring=2, dtype="float32")
    r.add_adapter("a", lora, nudged(cfg, lora, 1))
    r.add_adapter("b", lora, nudged(cfg, lora, 2))
    reqs = [request(PROMPTS[p], 10, name) for p, name in ((0, "a"), (2, "b"), (0, None), (4, "a"))]
    serve(r, {0: [q for q, _ in reqs]})
    got = [done[0].tokens.tolist() for _, done in reqs]
    params = GenerateParams(max_new_tokens=10)
    alone = []
    for p, seed in ((0, 1), (2, 2), (0, None), (4, 1)):
        r.use_adapter(*((lora, nudged(cfg, lora, seed)) if seed else (None, None)))
        alone.append(r.generate([np.asarray(PROMPTS[p])], params, [0])[0].tokens.tolist())
    r.close()
    assert got == alone
    assert got[0] != got[2]  # the adapter matters
