"""A classification's per-label results: precision, recall, support and the confusion matrix,
an answer outside the label set counted as (other)."""

from __future__ import annotations

from spill.jobs.rows.eval import OTHER, label_results


def test_per_label_precision_recall_and_confusion():
    rows = [("a", "a"), ("a", "b"), ("a", "maybe"), ("b", "b"), ("b", " b\n"), ("c", "a")]
    records = [{"answer": gold, "output": said} for gold, said in rows]
    got = label_results(records, ("a", "b", "c"))
    assert got["confusion"] == {
        "a": {"a": 1, "b": 1, "c": 0, OTHER: 1},
        "b": {"a": 0, "b": 2, "c": 0, OTHER: 0},
        "c": {"a": 1, "b": 0, "c": 0, OTHER: 0},
    }
    assert got["labels"] == {
        "a": {"precision": 0.5, "recall": round(1 / 3, 6), "support": 3},
        "b": {"precision": round(2 / 3, 6), "recall": 1.0, "support": 2},
        "c": {"precision": None, "recall": 0.0, "support": 1},  # never said: no precision
    }
