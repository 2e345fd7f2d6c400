"""The JSON of OpenAI's answers: completion and chat choices, their log-probs, usage, chunks.

Log-probs are the model's raw log-softmax (before temperature) as the engine reports them
(``spill.engines.base.Token``). A completion's are OpenAI's first shape (``tokens``,
``token_logprobs``, ``top_logprobs`` as {token text: log-prob}, ``text_offset``); a chat's the
newer one (``content``: token, logprob, bytes, top_logprobs). A token's text is the token
decoded alone; a prompt's first token has no log-prob (null).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from spill.models.tokenizer import Tokenizer
from spill.serve.text import Piece


def finish_reason(engine: str, stopped: bool) -> str:
    """OpenAI's finish reason: ``stop`` at an end token or a stop string, else ``length`` (a
    row cut at shutdown too)."""
    return "stop" if stopped or engine == "stop" else "length"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def head(rid: str, kind: str, model: str) -> dict:
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}  # fmt: skip


class Logprobs:
    """Turns pieces into either shape; the tokenizer names the top tokens."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        if token_id not in self._text:
            self._text[token_id] = self.tok.decode([token_id])
        return self._text[token_id]

    def completion(self, pieces: Sequence[Piece], base: int = 0) -> dict:
        """OpenAI's completions shape; ``base``: the offset of the pieces' text in the choice's
        (an echoed prompt before a completion)."""
        top = []
        for p in pieces:
            if p.token.logprob is None:
                top.append(None)
                continue
            names: dict[str, float] = {}
            for i, lp in p.token.top:
                names.setdefault(self.text(i), lp)  # two ids may decode alike: the likelier
            top.append(names)
        return {
            "tokens": [p.text for p in pieces],
            "token_logprobs": [p.token.logprob for p in pieces],
            "top_logprobs": top,
            "text_offset": [base + p.offset for p in pieces],
        }

    def _entry(self, text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, pieces: Sequence[Piece]) -> dict:
        """OpenAI's chat shape."""
        content = []
        for p in pieces:
            entry = self._entry(p.text, p.token.logprob)
            entry["top_logprobs"] = [self._entry(self.text(i), lp) for i, lp in p.token.top]
            content.append(entry)
        return {"content": content}


def merge_completion(a: dict | None, b: dict) -> dict:
    """Two completion log-probs one after the other (an echoed prompt, then the completion)."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}
