"""A chat template is someone else's code: a render is bounded in size and time (issue 35 item
13), and whatever a template does wrong is one ``TokenizerError`` line, never a traceback."""

from __future__ import annotations

import time

import pytest

from spill.errors import TokenizerError
from spill.models.sources.tiny import write_tiny
from spill.models.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "hi"}]

# a template, and words of the line it must fail with
HOSTILE = [
    ("{{ 'a' * 40000000000 }}", "a repeat of 40,000,000,000"),
    (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "loops more than 1,000,000 times",
    ),
    (  # doubling through ~, join and + in a namespace: each a size, checked
        "{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s }}",
        "a ~ concatenation",
    ),
    (
        "{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = [ns.s, ns.s]|join %}"
        "{% endfor %}{{ ns.s }}",
        "join's result",
    ),
    (
        "{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}",
        "a sum",
    ),
    ("{{ 'x'|center(10000000000) }}", "an argument of 10,000,000,000"),
    ("{{ 'x'.ljust(10000000000) }}", "an argument of 10,000,000,000"),
    ("{{ '{:>300000000}'.format('a') }}", "a format width of 300,000,000"),
    ("{{ '%300000000s' % 'a' }}", "a format width of 300,000,000"),
    ("{{ 10 ** 100000000 }}", "a number of more than"),
    ("{{ ('a' * 900000)|replace('a', 'bbbbbbbbbb') }}", "replace's result"),
    ("{{ ('\n' * 900000)|indent(900000) }}", "indent of"),
    ("{{ [1] * 1000000000 }}", "a repeat of 1,000,000,000"),
    ("{% for i in range(2000) %}{{ 'a' * 1000 }}{% endfor %}", "the rendered text"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses too deeply"),
    ("{{ messages[0]['content'] + 1 }}", "TypeError: can only concatenate"),
    ("{{ raise_exception('bad\nrole') }}", "chat template failed: bad role;"),
    ("{% for %}", "Expected an expression"),
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(write_tiny(tmp_path_factory.mktemp("t") / "m", family="qwen2", seed=3))


def _with(tok: Tokenizer, source: str) -> Tokenizer:
    tok.__dict__.pop("_template", None)
    tok.__dict__["chat_template"] = source
    return tok


@pytest.mark.parametrize("source,words", HOSTILE, ids=[w for _, w in HOSTILE])
def test_a_hostile_template_is_one_line_soon(tok, source, words):
    start = time.monotonic()
    with pytest.raises(TokenizerError) as got:
        _with(tok, source).apply_chat_template(MESSAGES)
    message = str(got.value)
    assert words in message and "\n" not in message, message
    assert message.endswith("fix or replace the model's chat template")
    assert time.monotonic() - start < 30  # generous: each stops in well under a second here


def test_a_real_template_renders_as_before_and_loops_keep_their_length(tok):
    """``loop.last``/``loop.length`` still work through the counted loops, and a long message
    (past ``MIN_CHARS``) renders: the bound grows with what the template is given."""
    source = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% if not loop.last %}|{% endif %}{{ loop.length }}{% endfor %}"
    )
    long = "x" * 3_000_000
    two = [*MESSAGES, {"role": "assistant", "content": long}]
    assert _with(tok, source).apply_chat_template(two) == f"user:hi|2assistant:{long}2"


def test_encode_last_keeps_the_tail_and_encodes_only_what_it_needs(tok):
    text = "hello world " * 100_000
    whole = tok.encode(text)
    ids, cut = tok.encode_last(text, 50)
    assert cut and len(ids) == 50 and ids == whole[-50:]
    assert tok.encode_last("hello", 50) == (tok.encode("hello"), False)
