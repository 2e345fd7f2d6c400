"""Preference rows -> pairs of token ids, and micro-batches of pairs as a pure function of position.

A row is ``{"prompt" | "messages", "chosen", "rejected"}``. Each answer is tokenized as TRL's
DPOTrainer does: the prompt and the answer together, the answer's tokens being those past the
prompt's (a text answer ends with the end-of-sequence token; a chat answer is an assistant turn,
ended by the template). Pair ``i`` of a micro-batch of P is rows ``i`` (chosen) and ``P + i``
(rejected), TRL's concatenated batch; which pairs is ``data.rows_at``, as for SFT rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from spill.errors import DataError
from spill.jobs.inputs import read_jsonl
from spill.jobs.tune.data import MicroBatch, rows_at


@dataclass(frozen=True)
class Pair:
    prompt: int  # the prompt's tokens, at the start of both sequences
    chosen: np.ndarray  # (T,) int64: prompt + chosen answer
    rejected: np.ndarray  # (T,) int64: prompt + rejected answer


@dataclass(frozen=True)
class PairBatch(MicroBatch):
    answer: np.ndarray  # (2P, T) bool: the answers' tokens
    pairs: int  # P


def _answer_text(row: dict, key: str, where: str) -> str | list[dict]:
    value = row.get(key)
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: '{key}' is empty; give both answers some text")
        return value
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        return value  # TRL's conversational form: the assistant turn(s)
    raise DataError(
        f"{where}: a preference row needs '{key}' (a string, or a list of assistant "
        "messages); give 'prompt' (or 'messages'), 'chosen' and 'rejected'"
    )


def _chat(tokenizer, prompt: list[dict], answer, where: str) -> tuple[list[int], list[int]]:
    if not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
        raise DataError(f"{where}: the prompt's messages must be {{role, content}} objects")
    turns = [{"role": "assistant", "content": answer}] if isinstance(answer, str) else answer
    head = tokenizer.encode_chat(prompt, add_generation_prompt=True)
    whole = tokenizer.encode_chat(prompt + turns, add_generation_prompt=False)
    if whole[: len(head)] != head:
        raise DataError(
            f"{where}: the chat template does not extend the prompt with the answer; give the "
            "rows as text prompt/chosen/rejected instead"
        )
    return head, whole[len(head) :]


def _text(tokenizer, prompt: str, answer: str, bos: bool) -> tuple[list[int], list[int]]:
    if bos:  # TRL's ORPOTrainer: no special tokens, then the BOS token if the prompt lacks it
        head, whole = tokenizer.encode(prompt, False), tokenizer.encode(prompt + answer, False)
        first = tokenizer.token_id(tokenizer.bos_token) if tokenizer.bos_token else None
        if first is not None and head[:1] != [first]:
            head, whole = [first, *head], [first, *whole]
    else:  # TRL's DPOTrainer: the tokenizer's own special tokens
        head, whole = tokenizer.encode(prompt), tokenizer.encode(prompt + answer)
    tail = whole[len(head) :]  # TRL's split: past the prompt's own tokens
    # TRL appends the tokenizer's own end-of-sequence token (the model may stop at others too)
    named = tokenizer.token_id(tokenizer.eos_token) if tokenizer.eos_token else None
    end = named if named is not None else (tokenizer.eos_ids[0] if tokenizer.eos_ids else None)
    if end is not None and (not tail or tail[-1] != end):
        tail = tail + [end]
    return head, tail


def encode_pair(tokenizer, row: dict, where: str, bos: bool = False) -> Pair:
    """One row's pair; ``bos``: tokenized as TRL's ORPOTrainer does (see ``_text``)."""
    prompt = row["messages"] if "messages" in row else row.get("prompt")
    chosen = _answer_text(row, "chosen", where)
    rejected = _answer_text(row, "rejected", where)
    if chosen == rejected:
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same; nothing to prefer")
    if isinstance(prompt, list) and prompt:
        (head, c), (_, r) = (_chat(tokenizer, prompt, a, where) for a in (chosen, rejected))
    elif isinstance(prompt, str) and isinstance(chosen, str) and isinstance(rejected, str):
        (head, c), (_, r) = (_text(tokenizer, prompt, a, bos) for a in (chosen, rejected))
    else:
        raise DataError(
            f"{where}: a preference row needs 'prompt' (text, with text answers) or 'messages' "
            "(a chat) beside 'chosen' and 'rejected'"
        )
    if not head:
        raise DataError(f"{where}: the prompt has no tokens; give it some text")
    if not c or not r:
        raise DataError(f"{where}: an answer has no tokens of its own; give both answers text")
    ids = (np.asarray(head + a, dtype=np.int64) for a in (c, r))
    return Pair(len(head), *ids)


def load_pairs(path: Path, tokenizer, seq_len: int, bos: bool = False) -> list[Pair]:
    """Every row of a JSONL file, each sequence cut to ``seq_len`` tokens (TRL's keep_start);
    ``bos``: as ``encode_pair``."""
    out = []
    for lineno, row in read_jsonl(path):
        where = f"{path}:{lineno}"
        pair = encode_pair(tokenizer, row, where, bos)
        if pair.prompt >= seq_len:
            raise DataError(
                f"{where}: the prompt fills --seq-len {seq_len}; nothing of either answer is "
                "left to compare: shorten the prompt or raise --seq-len"
            )
        out.append(Pair(pair.prompt, pair.chosen[:seq_len], pair.rejected[:seq_len]))
    return out


def pair_batch_at(
    pairs: list[Pair], seed: int, index: int, size: int, pad_id: int, whole_chosen: bool = False
) -> PairBatch:
    """Micro-batch ``index`` of ``size`` pairs: the chosen sequences, then the rejected. Targets
    are the answers' tokens; with ``whole_chosen`` (ORPO's NLL) every token of a chosen sequence
    after its first."""
    rows = rows_at(len(pairs), seed, index, size)
    seqs = [pairs[r].chosen for r in rows] + [pairs[r].rejected for r in rows]
    starts = [pairs[r].prompt for r in rows] * 2
    t = max(len(s) for s in seqs)
    tokens = np.full((2 * size, t), pad_id, dtype=np.int64)
    attention = np.zeros((2 * size, t), dtype=bool)
    answer = np.zeros((2 * size, t), dtype=bool)
    for b, (s, start) in enumerate(zip(seqs, starts, strict=True)):
        tokens[b, : len(s)] = s
        attention[b, : len(s)] = True
        answer[b, start : len(s)] = True
    targets = answer.copy()
    if whole_chosen:
        targets[:size] = attention[:size]
    targets[:, 0] = False  # nothing predicts the first token
    return PairBatch(tokens, attention, targets, tuple(rows), answer, size)
