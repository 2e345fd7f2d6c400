"""A row's streamed text (``spill.serve.text.Text``) with a real byte-level tokenizer: what is
shown adds up to the whole decoded text, half characters and possible stop-string starts wait,
a stop string cuts the text before it, and each token is released with the text it starts in."""

from __future__ import annotations

import pytest

from spill.engines.base import Token
from spill.models.tokenizer import Tokenizer
from spill.serve.text import Text


@pytest.fixture(scope="module")
def tok(tiny_models) -> Tokenizer:
    return Tokenizer(tiny_models["qwen2"])


def feed(text: Text, ids: list[int]) -> tuple[list[str], list, tuple[str, list]]:
    """The shown text after each token, the pieces released, and ``finish``'s return."""
    shown, pieces = [], []
    for i in ids:
        new, got = text.add(Token(i, -1.0))
        shown.append(new)
        pieces += got
    last = text.finish()
    return shown, pieces + last[1], last


def test_without_stops_everything_is_shown_once_with_every_token(tok):
    ids = tok.encode("hello é€ world", False)
    shown, pieces, (tail, _) = feed(Text(tok), ids)
    assert "".join(shown) + tail == tok.decode(ids)
    assert [p.token.id for p in pieces] == ids
    offsets = [p.offset for p in pieces]
    assert offsets == sorted(offsets) and offsets[0] == 0


def test_half_a_character_waits_for_the_rest(tok):
    ids = tok.encode("é", False)
    assert len(ids) == 2  # two byte tokens
    shown, _, _ = feed(Text(tok), ids)
    assert shown == ["", "é"]


def test_a_stop_string_across_tokens_cuts_the_text_and_stops(tok):
    ids = tok.encode("hello world and more", False)
    text = Text(tok, ["lo w", "zzz"])
    shown, pieces, (tail, _) = feed(text, ids)
    assert "".join(shown) + tail == "hel" and text.stopped
    assert "".join(p.text for p in pieces) == "hel"  # the stop string's tokens are not reported


def test_text_that_could_start_a_stop_string_waits_and_is_shown_at_the_end(tok):
    ids = tok.encode("abcx", False)
    text = Text(tok, ["xyz"])
    shown, _, (tail, _) = feed(text, ids)
    assert shown == ["", "", "a", "b"] and tail == "cx" and not text.stopped
