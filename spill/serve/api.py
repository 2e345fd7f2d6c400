"""What every route shares: the key check, the body read within ``BODY_MAX``, the model a
request names, the context check, and a request's rows in and events out of the batcher.

A client that leaves (mid-stream, or while its rows wait or run) cancels its rows: they end
at their next token and free their places. ``log`` is the one line a request leaves on stderr.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator

from fastapi import Request

from spill.console import note
from spill.serve.batcher import Batcher, Refused, Row
from spill.serve.open import Served
from spill.serve.parse import ApiError, read_json
from spill.serve.shape import Logprobs

BODY_MAX = 1 << 20  # bytes a request body may have
POLL = 0.5  # seconds between two checks that a waiting client is still there


def too_big() -> ApiError:
    return ApiError(413, f"the body is over {BODY_MAX >> 20} MiB; send a smaller request")


def failed(message: str) -> ApiError:
    """A row that did not finish: the server stopping (503) or the engine failing (500)."""
    status = 503 if "shutting down" in message else 500
    return ApiError(status, message, None, "unavailable", "server_error")


def sse(doc: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


class Api:
    def __init__(self, served: Served, batcher: Batcher, key: str | None) -> None:
        self.served, self.batcher, self.key = served, batcher, key
        self.tok = served.loaded.tokenizer
        self.logprobs = Logprobs(self.tok)

    def check_key(self, request: Request) -> None:
        if self.key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.key.encode()
        ):
            raise ApiError(401, "a valid API key is needed: send Authorization: Bearer KEY",
                           None, "invalid_api_key", "authentication_error")  # fmt: skip

    async def body(self, request: Request) -> dict:
        """The request's JSON object, after the key check; at most ``BODY_MAX`` bytes read."""
        self.check_key(request)
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) > BODY_MAX:
            raise too_big()
        chunks, got = [], 0
        async for chunk in request.stream():
            got += len(chunk)
            if got > BODY_MAX:
                raise too_big()
            chunks.append(chunk)
        return read_json(b"".join(chunks))

    def adapter(self, model: str | None) -> str | None:
        """The adapter ``model`` names (None: the base), or a 404."""
        adapter = self.served.adapter_of(model)
        if adapter is False:
            names = ", ".join([self.served.name, *self.served.adapters])
            raise ApiError(404, f"the model {model!r} is not served here; serving: {names}"[:500],
                           "model", "model_not_found")  # fmt: skip
        return adapter

    def check_room(self, n: int, max_tokens: int, what: str) -> None:
        """A prompt of ``n`` tokens and ``max_tokens`` new ones fit the model's context."""
        if n == 0:
            raise ApiError(400, f"the {what} is empty (no tokens); send some text", what)
        if n + max_tokens > self.served.context:
            raise ApiError(
                400,
                f"the {what} takes {n} tokens; with max_tokens {max_tokens} that passes the "
                f"model's context of {self.served.context}: shorten it or lower max_tokens",
                what, "context_length_exceeded",
            )  # fmt: skip

    def submit(self, rows: list[Row]) -> asyncio.Queue:
        try:
            return self.batcher.submit(rows, asyncio.get_running_loop())
        except Refused as e:
            raise ApiError(e.status, str(e), None, "unavailable", "server_error") from None

    async def events(
        self, rows: list[Row], queue: asyncio.Queue, request: Request
    ) -> AsyncIterator[tuple[int, tuple]]:
        """(choice, event) until every row is done or failed; leaving early (the client left,
        or the caller stopped reading) cancels the rows still open."""
        left, check = len(rows), time.monotonic() + POLL
        try:
            while left:
                try:
                    index, event = await asyncio.wait_for(queue.get(), POLL)
                except asyncio.TimeoutError:  # Python 3.10: not the builtin one yet
                    index, event = None, None
                if time.monotonic() >= check:  # tokens may flow to a client long gone
                    check = time.monotonic() + POLL
                    if await request.is_disconnected():
                        return
                if event is None:
                    continue
                left -= event[0] in ("done", "error")
                yield index, event
        finally:
            for row in rows:  # a finished row ignores it; the others end at their next token
                row.cancel()

    def log(self, rid: str, model: str, tokens_in: int, tokens_out: int, start: float, how: str):
        took = time.monotonic() - start
        note(f"spill serve: {rid} · {model} · {tokens_in} in · {tokens_out} out · "
             f"{took:.2f} s · {how}")  # fmt: skip
