"""Training rows -> token ids with a loss mask, and batches as a pure function of position.

Rows are ``{"prompt", "completion"}`` (loss on the completion), ``{"messages": [...]}`` (chat
template; loss on the assistant turns) or ``{"text"}`` (loss on every token). Micro-batch ``i``
holds the samples at global positions ``i*mb .. i*mb+mb-1``; position ``p`` falls in epoch
``p // N`` whose order is a permutation seeded by ``(seed, epoch)``. So a batch depends on
``(seed, i)`` alone, and the data cursor (the next micro-batch index) is the whole data state.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from spill.errors import DataError
from spill.ground.hashing import file_sha256
from spill.jobs.inputs import read_jsonl


@dataclass(frozen=True)
class Example:
    ids: np.ndarray  # (T,) int64
    targets: np.ndarray  # (T,) bool: the token at t is predicted and counted in the loss


@dataclass(frozen=True)
class MicroBatch:
    tokens: np.ndarray  # (B, T) int64, right-padded
    attention: np.ndarray  # (B, T) bool, real tokens
    targets: np.ndarray  # (B, T) bool, tokens whose prediction (from position t-1) counts
    rows: tuple[int, ...]  # row indices into the data set

    @property
    def n_targets(self) -> int:
        return int(self.targets.sum())


def _assistant_spans(tokenizer, messages: list[dict]) -> Example:
    """Tokenize a chat; targets are the tokens that each assistant turn adds to the prefix."""
    ids: list[int] = []
    targets: list[bool] = []
    for k in range(len(messages)):
        prefix_ids = tokenizer.encode_chat(messages[: k + 1], add_generation_prompt=False)
        if prefix_ids[: len(ids)] != ids:
            raise DataError(
                "the chat template does not extend turn by turn; give rows as prompt/completion instead"
            )
        new = prefix_ids[len(ids) :]
        if messages[k]["role"] == "assistant":
            # the generation prompt belongs to the context, not to what the model must learn
            head = tokenizer.encode_chat(messages[:k], add_generation_prompt=True)[len(ids) :]
            n_head = len(head) if new[: len(head)] == head else 0
            targets += [False] * n_head + [True] * (len(new) - n_head)
        else:
            targets += [False] * len(new)
        ids = prefix_ids
    return Example(np.asarray(ids, dtype=np.int64), np.asarray(targets, dtype=bool))


def encode_example(tokenizer, row: dict, where: str) -> Example:
    if "chosen" in row or "rejected" in row:
        raise DataError(
            f"{where}: a preference row (chosen/rejected) in a supervised tune; tune it with "
            "--method dpo or orpo (spill.yaml: tune.method)"
        )
    if "messages" in row:
        msgs = row["messages"]
        if not (
            isinstance(msgs, list)
            and msgs
            and all(isinstance(m, dict) and "role" in m and "content" in m for m in msgs)
        ):
            raise DataError(
                f"{where}: 'messages' must be a non-empty list of {{role, content}} objects"
            )
        if not any(m["role"] == "assistant" for m in msgs):
            raise DataError(f"{where}: no assistant turn to learn from; add one")
        return _assistant_spans(tokenizer, msgs)
    if isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        p = tokenizer.encode(row["prompt"])
        c = tokenizer.encode(row["completion"], add_special_tokens=False)
        if tokenizer.eos_ids:
            c = c + [tokenizer.eos_ids[0]]
        return Example(
            np.asarray(p + c, dtype=np.int64),
            np.asarray([False] * len(p) + [True] * len(c), dtype=bool),
        )
    if isinstance(row.get("text"), str):
        ids = tokenizer.encode(row["text"])
        return Example(
            np.asarray(ids, dtype=np.int64),
            np.asarray([False] + [True] * (len(ids) - 1), dtype=bool),
        )
    raise DataError(
        f"{where}: a training row needs 'prompt' and 'completion', 'messages', or 'text'"
    )


def load_examples(path: Path, tokenizer, seq_len: int) -> list[Example]:
    """Every row of a JSONL file, truncated to ``seq_len`` tokens."""
    out = []
    for lineno, row in read_jsonl(path):
        ex = encode_example(tokenizer, row, f"{path}:{lineno}")
        ex = Example(ex.ids[:seq_len], ex.targets[:seq_len])
        if not ex.targets[1:].any():
            raise DataError(
                f"{path}:{lineno}: nothing to learn within --seq-len {seq_len}; shorten the prompt or raise --seq-len"
            )
        out.append(ex)
    return out


@lru_cache(maxsize=8)
def epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    key = int.from_bytes(
        hashlib.sha256(f"spill-data:{seed}:{epoch}".encode()).digest()[:8], "little"
    )
    return tuple(int(i) for i in np.random.default_rng(key).permutation(n))


def rows_at(n: int, seed: int, index: int, size: int) -> list[int]:
    """The data set's rows in micro-batch ``index`` of ``size``, of a set of ``n``."""
    return [epoch_order(n, seed, p // n)[p % n] for p in range(index * size, (index + 1) * size)]


def micro_batch_at(
    examples: list[Example], seed: int, index: int, size: int, pad_id: int
) -> MicroBatch:
    """Micro-batch ``index`` of ``size`` samples: a pure function of its arguments."""
    rows = rows_at(len(examples), seed, index, size)
    chosen = [examples[r] for r in rows]
    t = max(len(e.ids) for e in chosen)
    tokens = np.full((size, t), pad_id, dtype=np.int64)
    attention = np.zeros((size, t), dtype=bool)
    targets = np.zeros((size, t), dtype=bool)
    for b, e in enumerate(chosen):
        tokens[b, : len(e.ids)] = e.ids
        attention[b, : len(e.ids)] = True
        targets[b, : len(e.ids)] = e.targets
    targets[:, 0] = False  # nothing predicts the first token
    return MicroBatch(tokens, attention, targets, tuple(rows))


def data_fingerprint(path: Path) -> str:
    return "sha256:" + file_sha256(path)  # the prefixed form checkpoints record
