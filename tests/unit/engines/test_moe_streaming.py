"""Routed experts read as routed (issue 41): where an MoE model's layers stream, a sparse layer
reads exactly the experts its tokens choose (transformers' own router says which), once per
forward without a cache and never again while a cache holds them; the cache stays inside its
bytes; the runner's stats count the bytes, and the pre-run words say it. Results are the
resident model's, bit for bit (tests/unit/engines/test_moe.py)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.unit.engines import hf_families
from tests.unit.engines.kit import open_runner

torch = pytest.importorskip("torch")
ROW = (np.arange(20, 22), np.arange(22, 24))  # 4 tokens: some experts go unchosen


@pytest.fixture(scope="module")
def folder(tmp_path_factory, tiny_models):
    root = tmp_path_factory.mktemp("moe-stream")
    spec = hf_families.MOE["qwen3_moe"]
    return hf_families.make("qwen3_moe", root / "m", tiny_models["llama"], spec=spec)


def routed(folder, ids: np.ndarray) -> list[set[int]]:
    """Each sparse layer's experts chosen by some token of ``ids``, by transformers' router."""
    hf = hf_families.load(folder)
    with torch.no_grad():
        logits = hf(torch.tensor(ids)[None], output_router_logits=True).router_logits
    k = hf.config.num_experts_per_tok
    return [set(torch.topk(t.float(), k, dim=-1).indices.flatten().tolist()) for t in logits]


def test_a_streamed_layer_reads_only_the_experts_its_tokens_choose(engine, folder):
    chosen = routed(folder, np.concatenate(ROW))
    runner = open_runner(engine, folder, ring=2, dtype="float32")
    experts = runner.model.ring.experts
    assert "experts read as routed (2 of 8 a token" in runner.info.weights
    runner.score([ROW[0]], [ROW[1]])
    one = experts.file_bytes(experts.names(0, 0))  # (48 x 64) x 3 float32
    assert one == 3 * 48 * 64 * 4
    got = dict(runner.stats.extra)
    assert got["experts_read"] == sum(len(c) for c in chosen) < 2 * 8
    assert got["expert_bytes_read"] == got["experts_read"] * one
    words = f"{got['experts_read'] * one / 1e6:.2f} MB of {16 * one / 1e6:.2f} MB"
    assert runner.stats.routed()["experts_read"].startswith(words)
    assert {e for (i, e) in experts._cache if i == 0} == chosen[0]
    assert got["expert_bytes_whole"] == 2 * 8 * one  # two sparse layers of 8 experts
    runner.score([ROW[0]], [ROW[1]])  # the cache holds them all: nothing is read again
    again = dict(runner.stats.extra)
    assert again["experts_read"] == got["experts_read"]
    assert again["experts_found"] == got["experts_found"] + sum(len(c) for c in chosen)
    runner.close()


def test_without_room_for_a_cache_each_forward_reads_its_experts_again(engine, folder):
    from spill.engines.core.budget import MIB
    from spill.engines.core.open import HEAP_SHARE

    roomy = open_runner(engine, folder, ring=2, dtype="float32", memory=2 * MIB)
    one = roomy.model.ring.experts.file_bytes(roomy.model.ring.experts.names(0, 0))
    left = roomy.model.ring.experts.capacity * HEAP_SHARE // (HEAP_SHARE - 1)  # about
    memory = 2 * MIB - left + (one + 64) * HEAP_SHARE // (HEAP_SHARE - 1)  # room for one expert
    roomy.close()
    runner = open_runner(engine, folder, ring=2, dtype="float32", memory=memory)
    experts = runner.model.ring.experts
    assert one <= experts.capacity < 2 * one
    runner.score([ROW[0]], [ROW[1]])
    first = runner.stats.extra["experts_read"]
    runner.score([ROW[0]], [ROW[1]])
    assert runner.stats.extra["experts_read"] == 2 * first  # every one read again
    assert experts.held <= 8 * one  # a layer's routed experts at most
    runner.close()


def _experts(folder, n: int):
    """An ``Experts`` of ``folder``'s model with room for ``n`` experts, on a stand-in reader
    (names in, the names as placeholders out), and one expert's bytes."""
    from spill.engines.core.experts import Experts
    from spill.engines.core.ring import Hooks
    from spill.models.config import load_config
    from spill.models.weights import weight_files

    class Reader:
        def tensors(self, names):
            return {n: n for n in names}

    one = 3 * 48 * 64 * 4
    return Experts(load_config(folder), Reader(), Hooks(), weight_files(folder), n * one), one


def walk(experts, chosen: dict[int, list[int]]) -> None:
    """One walk over the sparse layers: each attached, then its ``chosen`` experts read."""
    for i, es in chosen.items():
        experts.attach(i, {})
        experts.read(i, es)


def test_the_cache_lets_an_expert_its_layer_did_not_choose_again_go_first(folder):
    experts, one = _experts(folder, 3)
    walk(experts, {0: [1, 2], 2: [3]})
    experts.attach(0, {})
    experts.read(0, [1])  # 2 was not chosen again: the first to go
    experts.attach(2, {})
    experts.read(2, [4, 5])  # then 3, which layer 2 has just not chosen
    assert list(experts._cache) == [(0, 1), (2, 4), (2, 5)] and experts.held == 3 * one
    w = experts.attach(0, {"self_attn.q_proj.weight": "q"})
    assert w["mlp.experts.1.up_proj.weight"] == "model.layers.0.mlp.experts.1.up_proj.weight"
    assert w["self_attn.q_proj.weight"] == "q" and w.get("mlp.experts.1.up_proj.bias") is None
    experts.read(2, [0, 1, 2, 3])  # more than the cache holds: the layer's own all stay
    assert list(experts._cache) == [(2, 0), (2, 1), (2, 2), (2, 3)]
    assert (experts.reads, experts.hits) == (9, 1)


@pytest.fixture(scope="module")
def deep(tmp_path_factory, tiny_models):
    """Four sparse layers: a walk long enough for the order of eviction to matter."""
    name, extra = hf_families.MOE["qwen3_moe"]
    spec = (name, extra | {"num_hidden_layers": 4, "mlp_only_layers": []})
    root = tmp_path_factory.mktemp("moe-deep")
    return hf_families.make("qwen3_moe", root / "m", tiny_models["llama"], spec=spec)


def test_a_walk_longer_than_the_cache_still_finds_some_of_it(deep):
    """Walks whose experts outgrow the cache: the expert used last goes first (it is needed again
    last), as the optimal choice (the one needed furthest ahead) here, so each walk after the
    first finds what the room beside the layer at hand can keep (2 experts, 4 the first time);
    least recently used first evicts each expert just before the walk comes back to it and finds
    none."""
    experts, one = _experts(deep, 4)
    assert experts.cfg.sparse == (0, 1, 2, 3)
    chosen = {i: [0, 1] for i in range(4)}  # 8 experts a walk, room for 4
    walk(experts, chosen)
    assert (experts.reads, experts.hits) == (8, 0)
    for _ in range(3):
        walk(experts, chosen)
    assert (experts.reads, experts.hits) == (8 + 3 * 8 - 8, 4 + 2 + 2)
    assert list(experts._cache) == [(0, 0), (0, 1), (3, 0), (3, 1)] and experts.held == 4 * one
