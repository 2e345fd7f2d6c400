"""``POST /v1/chat/completions``: the messages through the model's chat template, one reply.

The rendered conversation is encoded as ``spill chat`` encodes it (no special tokens added:
the template wrote them); the reply ends at an end token of the model, a stop string, or
``max_tokens`` (default: what the context leaves, at most ``CHAT_DEFAULT``). Streamed,
the first chunk's delta names the role, the next ones carry content, the last the finish reason.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from spill.engines.base import GenerateParams
from spill.errors import TokenizerError
from spill.serve.api import DONE, Api, failed, sse
from spill.serve.batcher import Row
from spill.serve.parse import ApiError, parse_chat
from spill.serve.shape import finish_reason, head, new_id, usage
from spill.serve.text import Text

CHAT_DEFAULT = 1024  # new tokens of a reply whose request names no max_tokens (at most)


async def _encode(api: Api, messages: list[dict], max_tokens: int | None) -> tuple[list[int], int]:
    """The conversation's tokens and the reply's most new tokens, or a 400."""
    tok, context = api.tok, api.served.context
    if not tok.chat_template:
        raise ApiError(400, "the model has no chat template; use /v1/completions", "messages")
    try:
        text = await asyncio.to_thread(tok.apply_chat_template, messages)
    except TokenizerError as e:
        raise ApiError(400, str(e), "messages") from None
    room = context - (max_tokens or 1)
    ids, long = await asyncio.to_thread(tok.encode_last, text, max(room, 1), False)
    if long:
        raise ApiError(
            400,
            f"the messages take more than the {room} tokens that the model's context "
            f"({context}) leaves beside the reply; send fewer or shorter ones, or lower max_tokens",
            "messages", "context_length_exceeded",
        )  # fmt: skip
    new = min(CHAT_DEFAULT, context - len(ids)) if max_tokens is None else max_tokens
    api.check_room(len(ids), new, "messages")
    return ids, new


async def chat_completions(api: Api, request: Request):
    start, rid = time.monotonic(), new_id("chatcmpl")
    body = await api.body(request)
    ask = parse_chat(body, api.served.context)
    a = ask.ask
    adapter = api.adapter(a.model)
    ids, new = await _encode(api, list(ask.messages), a.max_tokens)
    name = a.model or api.served.name
    params = GenerateParams(new, a.temperature, a.top_p, tuple(api.tok.eos_ids))
    text = Text(api.tok, a.stops)
    row = Row(np.asarray(ids, np.int64), params, text, a.seed % (1 << 63), adapter,
              ask.top_logprobs)  # fmt: skip
    top = head(rid, "chat.completion", name)
    want = ask.top_logprobs is not None
    state = {"out": 0, "finish": None}

    def take(event: tuple) -> tuple[str, list]:
        if event[0] == "done":
            gen = event[3]
            state["out"], state["finish"] = len(gen.tokens), finish_reason(gen.finish, text.stopped)
        return event[1], event[2]

    def done(how: str) -> None:
        api.log(rid, name, len(ids), state["out"], start, how)

    if new == 0:  # max_tokens 0: an empty reply, nothing to compute
        state["finish"] = "length"
        events = None
    else:
        events = api.events([row], api.submit([row]), request)

    if not a.stream:
        content, pieces = "", []
        async for _, event in events or _nothing():
            if event[0] == "error":
                done("failed")
                raise failed(event[1])
            new_text, new_pieces = take(event)
            content, pieces = content + new_text, pieces + new_pieces
        done(state["finish"] or "client left")
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "logprobs": api.logprobs.chat(pieces) if want else None,
            "finish_reason": state["finish"],
        }
        return JSONResponse({**top, "choices": [choice], "usage": usage(len(ids), state["out"])})

    chunk = {**top, "object": "chat.completion.chunk"}

    def one(delta: dict, pieces: list | None = None, finish: str | None = None) -> bytes:
        lp = api.logprobs.chat(pieces) if want and pieces is not None else None
        return sse({**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                          "finish_reason": finish}]})  # fmt: skip

    async def stream():
        how = "client left"
        try:
            yield one({"role": "assistant", "content": ""})
            async for _, event in events or _nothing():
                if event[0] == "error":
                    how = "failed"
                    yield sse(failed(event[1]).body())
                    return
                new_text, new_pieces = take(event)
                if new_text or new_pieces:
                    yield one({"content": new_text}, new_pieces)
            yield one({}, None, state["finish"])
            if a.usage_in_stream:
                yield sse({**chunk, "choices": [], "usage": usage(len(ids), state["out"])})
            yield DONE
            how = state["finish"]
        finally:
            done(how)

    return StreamingResponse(stream(), media_type="text/event-stream")


async def _nothing():
    return
    yield
