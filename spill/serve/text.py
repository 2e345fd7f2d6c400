"""One row's text as its tokens come: what may be shown now, and where a stop string cuts it.

The text is the decoded row so far (``spill.jobs.chat``'s rule): a tail that decodes to U+FFFD
(a character cut between byte tokens) waits for the next token, and so do the last characters
that could still begin a stop string. A stop string found cuts the text before it and ends the
row. Each token is released with the text it starts in, as a ``Piece`` (its own decoded text,
its offset in the row's text, its log-probs), so streamed log-probs follow the streamed text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from spill.engines.base import Token
from spill.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class Piece:
    """A token as a response reports it."""

    text: str  # the token decoded alone
    offset: int  # where it starts in the row's text (characters)
    token: Token


def pieces(tok: Tokenizer, tokens: Sequence[Token]) -> list[Piece]:
    """A prompt's tokens as pieces; offsets add up each token's own text (decoding every
    prefix of a long prompt would cost its length squared)."""
    out, at = [], 0
    for t in tokens:
        text = tok.decode([t.id])
        out.append(Piece(text, at, t))
        at += len(text)
    return out


class Text:
    """Feed it the row's tokens (``add``), then ``finish``; each returns (new text, the pieces
    released with it). ``stopped``: a stop string was found, the row should end."""

    def __init__(self, tok: Tokenizer, stops: Sequence[str] = ()) -> None:
        self.tok, self.stops = tok, tuple(s for s in stops if s)
        self.hold = max(map(len, self.stops), default=1) - 1  # characters a stop may still need
        self.ids: list[int] = []
        self.now = ""  # the row decoded so far
        self.shown = ""  # what was handed out
        self.waiting: list[Piece] = []  # pieces whose text is not shown yet
        self.stopped = False

    def add(self, token: Token) -> tuple[str, list[Piece]]:
        if self.stopped:
            return "", []
        self.waiting.append(Piece(self.tok.decode([token.id]), len(self.now), token))
        self.ids.append(token.id)
        now = self.tok.decode(self.ids)
        if now.endswith("\ufffd") or not now.startswith(self.shown):
            return "", []  # a character cut between tokens: wait for the rest
        self.now = now
        cut = self._stop_at(now)
        if cut is not None:
            self.stopped = True
            return self._show(now[:cut], final=True)
        return self._show(now[: len(now) - self.hold] if self.hold else now, final=False)

    def finish(self) -> tuple[str, list[Piece]]:
        """What is left once the row ended: the whole text, unless a stop string cut it."""
        if self.stopped:
            return "", []
        now = self.tok.decode(self.ids)
        if not now.startswith(self.shown):  # the tokenizer rewrote shown text: keep what was
            now = self.shown
        cut = self._stop_at(now)
        self.stopped = cut is not None
        return self._show(now if cut is None else now[:cut], final=True)

    def _stop_at(self, now: str) -> int | None:
        start = max(0, len(self.shown) - self.hold)  # a stop that ends in shown text was found
        found = [i for s in self.stops if (i := now.find(s, start)) >= 0]
        return min(found) if found else None

    def _show(self, upto: str, final: bool) -> tuple[str, list[Piece]]:
        if len(upto) < len(self.shown):
            upto = self.shown
        new, self.shown = upto[len(self.shown) :], upto
        if final:  # every piece that starts inside the text (all of them, but a cut's tail)
            out = [p for p in self.waiting if p.offset < len(upto) or not self.stopped]
            self.waiting = []
            return new, out
        n = next((i for i, p in enumerate(self.waiting) if p.offset >= len(upto)), None)
        n = len(self.waiting) if n is None else n
        out, self.waiting = self.waiting[:n], self.waiting[n:]
        return new, out
