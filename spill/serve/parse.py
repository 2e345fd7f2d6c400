"""Request bodies of OpenAI's completions and chat completions, checked field by field.

Every field is checked for its type and range before anything runs; a wrong one is an
``ApiError`` (HTTP 400, OpenAI's error shape, one sentence naming the field). Fields that
change nothing (``user``, penalties of 0, an empty ``logit_bias``) are accepted; those asking
for what spill does not do (``n`` or ``best_of`` > 1, penalties, a logit bias, a suffix, tools,
images, a JSON response format) are refused by name. A completion's ``prompt`` is a string, a list of strings, a list of token ids
or a list of such lists (what lm-evaluation-harness sends); each prompt is one choice.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass

LOGPROBS_MAX = 20  # the most likely tokens a response may list per position
STOPS_MAX = 16  # stop strings a request may give
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
UNSUPPORTED = ("tools", "functions", "tool_choice", "function_call", "logit_bias", "suffix")
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "best_of": 1}  # all spill does


class ApiError(Exception):
    """A request answered with ``status`` and OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind,
        )  # fmt: skip

    def body(self) -> dict:
        return {
            "error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}
        }  # fmt: skip


def bad(param: str, what: str) -> ApiError:
    return ApiError(400, f"'{param}' {what}", param, "invalid_value")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_json(raw: bytes) -> dict:
    """The body as a JSON object, or a 400 that says why it is none."""
    try:
        doc = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not UTF-8 text; send JSON", None, "invalid_json") from None
    except (ValueError, RecursionError) as e:
        why = e.msg if isinstance(e, json.JSONDecodeError) else str(e) or "nested too deeply"
        raise ApiError(400, f"the body is not valid JSON ({why})", None, "invalid_json") from None
    if not isinstance(doc, dict):
        raise ApiError(400, "the body must be a JSON object", None, "invalid_json")
    return doc


def _int(body: dict, key: str, default, lo: int, hi: int):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(key, f"must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise bad(key, f"must be between {lo} and {hi}, got {value}")
    return value


def _number(body: dict, key: str, default: float, lo: float, hi: float, low_open=False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad(key, f"must be a number, got {type(value).__name__}")
    if not (lo < value if low_open else lo <= value) or value > hi:
        side = "above" if low_open else "from"
        raise bad(key, f"must be {side} {lo:g} up to {hi:g}, got {value}")
    return float(value)


def _bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(key, f"must be true or false, got {type(value).__name__}")
    return value


def _stops(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise bad("stop", "must be a non-empty string or a list of them")
    if len(value) > STOPS_MAX:
        raise bad("stop", f"may hold at most {STOPS_MAX} strings, got {len(value)}")
    return tuple(value)


@dataclass(frozen=True)
class Ask:
    """What both endpoints share."""

    model: str | None
    max_tokens: int | None  # None: the endpoint's default
    temperature: float
    top_p: float
    seed: int
    stops: tuple[str, ...]
    stream: bool
    usage_in_stream: bool  # stream_options.include_usage


def _ask(body: dict, max_tokens_cap: int, token_key: str = "max_tokens") -> Ask:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model", f"must be a string, got {type(model).__name__}")
    if _int(body, "n", 1, 1, 1 << 31) != 1:
        raise ApiError(400, "'n' must be 1: spill serve makes one choice per prompt", "n")
    for key in UNSUPPORTED:
        if body.get(key):
            raise ApiError(400, f"'{key}' is not supported by spill serve", key, "unsupported")
    for key, neutral in NEUTRAL.items():
        if body.get(key) not in (None, neutral):
            why = f"'{key}' other than {neutral} is not supported by spill serve"
            raise ApiError(400, why, key, "unsupported")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") not in ("text", None)):
        raise ApiError(400, "'response_format' may only be text here", "response_format")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options", "must be an object")
    cap = max_tokens_cap
    return Ask(
        model=model,
        max_tokens=_int(body, token_key, None, 0, cap),
        temperature=_number(body, "temperature", 0.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=_int(body, "seed", secrets.randbits(31), -(1 << 63), (1 << 63) - 1),
        stops=_stops(body),
        stream=_bool(body, "stream"),
        usage_in_stream=_bool(options or {}, "include_usage"),
    )


@dataclass(frozen=True)
class CompletionAsk:
    ask: Ask
    prompts: tuple[str | tuple[int, ...], ...]  # text, or token ids
    logprobs: int | None
    echo: bool


def _prompts(value, vocab: int) -> tuple[str | tuple[int, ...], ...]:
    def ids(x) -> bool:
        return isinstance(x, list) and x and all(type(i) is int and 0 <= i < vocab for i in x)

    if isinstance(value, str):
        return (value,)
    if ids(value):
        return (tuple(value),)
    if isinstance(value, list) and value and all(isinstance(p, str) or ids(p) for p in value):
        return tuple(p if isinstance(p, str) else tuple(p) for p in value)
    raise bad(
        "prompt",
        f"must be a string, a list of strings, or non-empty lists of token ids below {vocab}",
    )


def parse_completion(body: dict, max_tokens_cap: int, vocab: int) -> CompletionAsk:
    if "prompt" not in body:
        raise ApiError(400, "'prompt' is required", "prompt", "missing")
    ask = _ask(body, max_tokens_cap)
    logprobs = _int(body, "logprobs", None, 0, LOGPROBS_MAX)
    return CompletionAsk(ask, _prompts(body["prompt"], vocab), logprobs, _bool(body, "echo"))


@dataclass(frozen=True)
class ChatAsk:
    ask: Ask
    messages: tuple[dict, ...]  # {"role", "content"}, content as text
    top_logprobs: int | None  # None: no log-probs; 0: the chosen token's only


def _content(value, at: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"'{at}': only text parts are supported, not {kind}", at)
            if not isinstance(part.get("text"), str):
                raise bad(f"{at}.text", "must be a string")
            texts.append(part["text"])
        return "".join(texts)
    raise bad(at, "must be a string or a list of text parts")


def _messages(value) -> tuple[dict, ...]:
    if not isinstance(value, list) or not value:
        raise bad("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(at, "must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{at}.role", f"must be one of {', '.join(ROLES)}, got {role!r}"[:200])
        out.append({"role": ROLES[role], "content": _content(m.get("content"), f"{at}.content")})
    return tuple(out)


def parse_chat(body: dict, max_tokens_cap: int) -> ChatAsk:
    if "messages" not in body:
        raise ApiError(400, "'messages' is required", "messages", "missing")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    ask = _ask(body, max_tokens_cap, key)
    top = _int(body, "top_logprobs", None, 0, LOGPROBS_MAX)
    if top is not None and not _bool(body, "logprobs"):
        raise bad("top_logprobs", "needs 'logprobs': true")
    logprobs = (top or 0) if _bool(body, "logprobs") else None
    return ChatAsk(ask, _messages(body["messages"]), logprobs)
