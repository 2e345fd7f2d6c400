"""Label choice by log-probability: the highest total wins (the first on a tie), probabilities
are the softmax over the labels, and a batch of prompts scores as each prompt alone does."""

from __future__ import annotations

import math

import numpy as np

from spill.jobs.rows.scoring import answer_ids, choose, choose_labels, softmax, total
from spill.models.tokenizer import Tokenizer
from tests.unit.engines.kit import load_engine, open_runner


def test_choose_takes_the_highest_total_and_softmaxes_over_the_labels():
    got = choose(("a", "b", "c"), [-3.0, -1.0, -2.0])
    assert got.label == "b" and got.logprobs == {"a": -3.0, "b": -1.0, "c": -2.0}
    want = math.exp(-1) / (math.exp(-3) + math.exp(-1) + math.exp(-2))
    assert abs(got.probability - want) < 1e-12
    assert choose(("a", "b"), [-1.0, -1.0]).label == "a"  # a tie: the first label
    assert abs(sum(softmax([-1000.0, -1001.0, -5.0])) - 1) < 1e-12
    assert softmax([-math.inf, -math.inf]) == [0.5, 0.5]
    assert total(np.array([-0.5, -0.25], np.float32)) == -0.75


def test_choose_labels_equals_scoring_each_label_alone(tiny_models):
    folder = tiny_models["llama"]
    runner = open_runner(load_engine("torch"), folder, resident=True, dtype="float32")
    tok = Tokenizer(folder)
    labels = ("red", "green", "a longer label")
    ids = [answer_ids(tok, x) for x in labels]
    prompts = [np.asarray(tok.encode(t), np.int64) for t in ("which colour?", "pick one of them")]
    try:
        got = choose_labels(runner, prompts, labels, ids)
        for prompt, choice in zip(prompts, got, strict=True):
            alone = [total(runner.score([prompt], [x])[0]) for x in ids]
            assert choice == choose(labels, alone) or all(
                abs(choice.logprobs[k] - v) < 1e-4 for k, v in zip(labels, alone, strict=True)
            )
            assert choice.label == labels[int(np.argmax(alone))]
    finally:
        runner.close()
