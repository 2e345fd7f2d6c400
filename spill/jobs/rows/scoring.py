"""Answers scored by their log-probability: what ``spill eval`` records about a row's gold
answer, and how ``spill predict`` chooses among a project's labels.

An answer is encoded without special tokens and with no end-of-sequence token; its score is
the sum (in float64) of its tokens' log-probs given the prompt (``Runner.score``). A choice
scores every label after the same prompt and takes the highest total (the first label on a
tie); a label's probability is the softmax of the totals over the label set, so the
probabilities of one row sum to 1 over the labels (not over everything the model could say).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def answer_ids(tokenizer, text: str) -> np.ndarray:
    """An answer's tokens as they are scored: no special tokens, no end of sequence."""
    return np.asarray(tokenizer.encode(text, False), dtype=np.int64)


def total(logprobs: np.ndarray) -> float:
    """An answer's summed log-prob (float64), from its per-token log-probs."""
    return float(np.sum(logprobs, dtype=np.float64))


@dataclass(frozen=True)
class Choice:
    label: str
    probability: float  # softmax over the labels' totals
    logprobs: dict[str, float]  # each label's total


def softmax(totals: Sequence[float]) -> list[float]:
    top = max(totals)
    if not math.isfinite(top):  # every label impossible: no preference
        return [1.0 / len(totals)] * len(totals)
    weights = [math.exp(t - top) for t in totals]
    whole = sum(weights)
    return [w / whole for w in weights]


def choose(labels: Sequence[str], totals: Sequence[float]) -> Choice:
    """The label with the highest total (the first on a tie) and its probability."""
    probs = softmax(totals)
    best = max(range(len(labels)), key=lambda i: (totals[i], -i))
    return Choice(labels[best], probs[best], dict(zip(labels, totals, strict=True)))


def choose_labels(
    runner, prompts: Sequence[np.ndarray], labels: Sequence[str], label_ids: Sequence[np.ndarray]
) -> list[Choice]:
    """One ``Choice`` per prompt, every label scored after it in one ``score`` call."""
    n = len(labels)
    scores = runner.score(
        [p for p in prompts for _ in range(n)], [ids for _ in prompts for ids in label_ids]
    )
    return [
        choose(labels, [total(lp) for lp in scores[i * n : (i + 1) * n]])
        for i in range(len(prompts))
    ]
