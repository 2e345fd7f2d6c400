"""A model's chat template (``ChatTemplate``): compiled once in jinja's immutable sandbox, rendered
within bounds. A chat template comes with a downloaded model, so it is someone else's code; a
template past a bound fails with one ``TemplateError`` (the tokenizer's one line).

Bounds: size (the text, and every string or list a template makes on the way, at most ``limit``
characters or items, a number at most ``MAX_BITS`` bits: ``MIN_CHARS`` plus ``GROWTH`` times the
characters it is given) and time (``SECONDS`` a render and ``MAX_STEPS`` loop iterations in all).
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
import time
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

# jinja's ``ImmutableSandboxedEnvironment`` keeps a template from Python's internals and from
# changing its inputs, but bounds neither what it makes nor how long it runs (``{{ 'a' * 40000000000
# }}`` is a MemoryError, two nested ``range(100000)`` loops run for hours). So:
# - size: an operation is checked before it runs where its size can be known (``*``, ``**``, ``%``,
#   ``+``, a numeric argument such as a width, ``replace``, ``join``, ``indent``, a format spec's
#   width), else its result right after (``~``, every filter and method), so nothing grows past a
#   small multiple of the limit;
# - time: jinja's ``MAX_RANGE`` bounds one range, not a nest of them; the steps and seconds are
#   checked at every iteration, call and piece of output.
MIN_CHARS = 1_000_000  # a render's size bound beyond GROWTH x its inputs' characters
GROWTH = 4  # a template writes each message about once; a few times is still a template
SECONDS = 10.0  # a render's time: real templates take milliseconds
MAX_STEPS = 1_000_000  # loop iterations in one render, all loops together
MAX_BITS = 1 << 16  # a number's size: far past any count, id or date a template needs
LOOP, SIZED = "spill_loop", "spill_sized"  # the filters the rewrite adds


class Exceeded(TemplateError):
    """A render past one of the bounds."""


class _Budget:
    def __init__(self, limit: int) -> None:
        self.limit, self.steps = limit, 0
        self.deadline = time.monotonic() + SECONDS

    def clock(self) -> None:
        if time.monotonic() > self.deadline:
            raise Exceeded(f"it ran longer than {SECONDS:g} s")

    def tick(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise Exceeded(f"it loops more than {MAX_STEPS:,} times")
        self.clock()

    def size(self, n: int, what: str) -> None:
        if n > self.limit:
            raise Exceeded(f"{what} of {n:,} passes the render's bound of {self.limit:,}")


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("spill_chat_budget")


def _budget() -> _Budget:
    """The render's budget; outside a render (jinja folding constants at compile time) this
    raises, so jinja leaves the expression to run, bounded, at render time."""
    return _BUDGET.get()


def _size(x: Any) -> int:
    """Characters of a string; items of a list, tuple or dict plus its strings' characters."""
    if isinstance(x, str):
        return len(x)
    if isinstance(x, (list, tuple, dict)):
        return len(x) + sum(len(i) for i in x if isinstance(i, str))
    return 0


def _chars(value: Any) -> int:
    """Characters of every string in the variables a render is given."""
    total, stack = 0, [value]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            total += len(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
    return total


def _bits(bits: int) -> None:
    if bits > MAX_BITS:
        raise Exceeded(f"it makes a number of more than {MAX_BITS:,} bits")


def _times(b: _Budget, x, y):
    if isinstance(x, int) and isinstance(y, int):
        _bits(abs(x).bit_length() + abs(y).bit_length())
    elif isinstance(y, int):
        b.size(_size(x) * y, "a repeat")
    elif isinstance(x, int):
        b.size(_size(y) * x, "a repeat")
    return x * y


def _power(b: _Budget, x, y):
    if isinstance(x, int) and isinstance(y, int) and y > 0 and abs(x) > 1:
        _bits(abs(x).bit_length() * y)
    return x**y


def _plus(b: _Budget, x, y):
    if isinstance(x, (str, list, tuple)):
        b.size(_size(x) + _size(y), "a sum")
    return x + y


_PERCENT = re.compile(r"%[-#0 +]*(\d*)(?:\.(\d*))?")


def _widths(b: _Budget, numbers) -> None:
    for n in numbers:
        if n and int(n) > b.limit:
            raise Exceeded(f"a format width of {int(n):,} passes the render's bound of {b.limit:,}")


def _modulo(b: _Budget, x, y):
    if isinstance(x, str):
        _widths(b, (n for pair in _PERCENT.findall(x) for n in pair))
        _arguments(b, y if isinstance(y, tuple) else (y,), {})
    return x % y


_BINOPS = {
    "*": _times,
    "**": _power,
    "+": _plus,
    "%": _modulo,
}


def _arguments(b: _Budget, args, kwargs) -> None:
    for n in (*args, *kwargs.values()):
        if isinstance(n, int) and not isinstance(n, bool) and n > b.limit:
            raise Exceeded(f"an argument of {n:,} passes the render's bound of {b.limit:,}")


def _estimate(b: _Budget, name: str, value, args, kwargs) -> None:
    """What a known grower would make, before it makes it (a method's or filter's arguments
    after the value it works on)."""
    if name == "replace" and isinstance(value, str) and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        count = value.count(old) if old else len(value) + 1
        b.size(len(value) + count * (len(new) - len(old)), "replace's result")
    elif name == "join" and isinstance(value, str) and args:  # sep.join(items)
        items = args[0]
        if isinstance(items, (list, tuple)):
            b.size(len(value) * len(items) + _size(items), "join's result")
    elif name in ("indent", "expandtabs") and isinstance(value, str):
        width = args[0] if args and isinstance(args[0], int) else 8
        b.size(len(value) + value.count("\n" if name == "indent" else "\t") * width, name)


def _filter(name: str, f):
    """A filter run within the budget: its arguments, a known grower's size, then the result."""
    skip = 2 if hasattr(f, "jinja_pass_arg") else 1  # (context,) value, then the arguments

    @functools.wraps(f)
    def run(*args, **kwargs):
        b = _budget()
        b.clock()
        _arguments(b, args[skip:], kwargs)
        value = args[skip - 1] if len(args) >= skip else None
        if name == "join" and isinstance(value, (list, tuple)):
            sep = args[skip] if len(args) > skip else kwargs.get("d", "")
            _estimate(b, "join", str(sep), (value,), {})
        else:
            _estimate(b, name, value, args[skip:], kwargs)
        out = f(*args, **kwargs)
        b.size(_size(out), f"the {name} filter's result")
        return out

    return run


def _loop(iterable):
    return _Counted(iterable, _budget())


class _Counted:
    """A loop's iterable, each iteration counted; its length, where it has one, kept for
    ``loop.length`` and ``loop.last``."""

    def __init__(self, iterable, budget: _Budget) -> None:
        self.iterable, self.budget = iterable, budget

    def __len__(self) -> int:
        return len(self.iterable)

    def __iter__(self):
        for item in self.iterable:
            self.budget.tick()
            yield item


def _sized(text):
    _budget().size(_size(text), "a ~ concatenation")
    return text


# Loops and ``~`` are bounded by rewriting the parsed template (each ``for``'s iterable and each
# ``~`` pass through a filter) before jinja compiles it, so the compiled code is jinja's own.
class _Bound(NodeTransformer):
    """Every ``for`` iterates through ``LOOP``; every ``~`` is checked by ``SIZED``."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, LOOP, [], [], None, None, lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        node = self.generic_visit(node)
        return nodes.Filter(node, SIZED, [], [], None, None, lineno=node.lineno)


class _Environment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(_BINOPS)

    def call_binop(self, context, operator: str, left, right):
        b = _budget()
        b.clock()
        return _BINOPS[operator](b, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        b = _budget()
        b.clock()
        _arguments(b, args, kwargs)
        name = getattr(__obj, "__name__", "")
        _estimate(b, name, getattr(__obj, "__self__", None), args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        b.size(_size(out), f"{name or 'a call'}'s result")
        return out

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:  # "{:>300000000}".format(x): the widths in its specs
            b = _budget()
            specs = (spec or "" for _, _, spec, _ in string.Formatter().parse(value.__self__))
            _widths(b, (n for spec in specs for n in re.findall(r"\d+", spec)))
        return wrapped


def _raise(message):
    raise TemplateError(message)


def _environment() -> _Environment:
    """Configured as transformers does (``trim_blocks``, ``lstrip_blocks``, ``tojson``,
    ``raise_exception``), so a hub model's template renders the same text here."""
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(
        x, ensure_ascii=False, indent=indent
    )
    env.filters = {name: _filter(name, f) for name, f in env.filters.items()}
    env.filters[LOOP], env.filters[SIZED] = _loop, _sized
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A template's source, compiled once (a training row renders it once per turn)."""

    def __init__(self, source: str) -> None:
        env = _environment()
        tree = _Bound().visit(env.parse(source))
        tree.set_environment(env)
        self._template = env.from_string(tree)

    def render(self, **variables: Any) -> str:
        """The text, within the bounds of the module doc (``Exceeded`` past one)."""
        b = _Budget(MIN_CHARS + GROWTH * _chars(variables))
        token = _BUDGET.set(b)
        try:
            out, n = [], 0
            for piece in self._template.generate(**variables):
                n += len(piece)
                b.size(n, "the rendered text")
                b.clock()
                out.append(piece)
            return "".join(out)
        finally:
            _BUDGET.reset(token)
