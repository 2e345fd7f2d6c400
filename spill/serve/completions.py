"""``POST /v1/completions``: each prompt one row and one choice, answered whole or streamed.

A text prompt is encoded as ``spill run`` encodes one (with the tokenizer's special tokens);
token ids are taken as they are. ``max_tokens`` defaults to 16 (OpenAI's); 0 with ``echo``
scores the prompt only (what log-likelihood clients ask). With ``echo`` a choice's text starts
with the prompt (its text as sent, or its ids decoded) and its log-probs with the prompt's.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from spill.engines.base import GenerateParams
from spill.serve.api import DONE, Api, failed, sse
from spill.serve.batcher import Row
from spill.serve.parse import parse_completion
from spill.serve.shape import finish_reason, head, merge_completion, new_id, usage
from spill.serve.text import Text, pieces

DEFAULT_TOKENS = 16  # OpenAI's max_tokens for completions


class Choice:
    """One prompt's answer as its events come."""

    def __init__(self, api: Api, row: Row, echo: str | None, logprobs: bool) -> None:
        self.api, self.row, self.echo, self.want = api, row, echo, logprobs
        self.base = len(echo) if echo is not None else 0  # the completion's offset in the text
        self.text, self.lp, self.finish, self.out = "", None, None, 0

    def take(self, event: tuple) -> tuple[str, dict | None, str | None]:
        """(new text, its log-probs, the finish reason once done) of one event."""
        lp = None
        if event[0] == "prompt":
            text = self.echo or ""
            lp = self.api.logprobs.completion(pieces(self.api.tok, event[1])) if self.want else None
        else:
            text = event[1]
            lp = self.api.logprobs.completion(event[2], self.base) if self.want else None
        if event[0] == "done":
            gen = event[3]
            self.finish, self.out = (
                finish_reason(gen.finish, self.row.text.stopped),
                len(gen.tokens),
            )
        self.text += text
        if lp is not None:
            self.lp = merge_completion(self.lp, lp)
        return text, lp, self.finish

    def json(self, index: int) -> dict:
        lp = self.lp if self.want else None
        if self.want and lp is None:
            lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        return {"index": index, "text": self.text, "logprobs": lp, "finish_reason": self.finish}


async def completions(api: Api, request: Request):
    start, rid = time.monotonic(), new_id("cmpl")
    body = await api.body(request)
    ask = parse_completion(body, api.served.context, api.served.vocab)
    a = ask.ask
    adapter = api.adapter(a.model)
    new = DEFAULT_TOKENS if a.max_tokens is None else a.max_tokens
    encoded = []
    for p in ask.prompts:
        ids = list(p) if isinstance(p, tuple) else await asyncio.to_thread(api.tok.encode, p)
        api.check_room(len(ids), new, "prompt")
        encoded.append(ids)
    name = a.model or api.served.name
    params = GenerateParams(new, a.temperature, a.top_p, tuple(api.tok.eos_ids))
    rows = [
        Row(np.asarray(ids, np.int64), params, Text(api.tok, a.stops), a.seed % (1 << 63),
            adapter, ask.logprobs, ask.echo)
        for ids in encoded
    ]  # fmt: skip
    echoes = [(p if isinstance(p, str) else api.tok.decode(p)) if ask.echo else None
              for p in ask.prompts]  # fmt: skip
    choices = [
        Choice(api, r, e, ask.logprobs is not None) for r, e in zip(rows, echoes, strict=True)
    ]
    tokens_in = sum(map(len, encoded))
    top = head(rid, "text_completion", name)
    if new == 0 and not ask.echo:  # nothing to compute: empty completions
        for c in choices:
            c.finish = "length"
        rows = []
    queue = api.submit(rows) if rows else asyncio.Queue()

    def done(how: str) -> None:
        api.log(rid, name, tokens_in, sum(c.out for c in choices), start, how)

    if not a.stream:
        async for i, event in api.events(rows, queue, request):
            if event[0] == "error":
                done("failed")
                raise failed(event[1])
            choices[i].take(event)
        left = any(c.finish is None for c in choices)  # events ended early: the client left
        done("client left" if left else ",".join(sorted({c.finish for c in choices})))
        out = {**top, "choices": [c.json(i) for i, c in enumerate(choices)]}
        return JSONResponse({**out, "usage": usage(tokens_in, sum(c.out for c in choices))})

    async def stream():
        how = "client left"
        try:
            if not rows:
                for i, c in enumerate(choices):
                    yield sse({**top, "choices": [c.json(i)]})
            async for i, event in api.events(rows, queue, request):
                if event[0] == "error":
                    how = "failed"
                    yield sse(failed(event[1]).body())
                    return
                text, lp, finish = choices[i].take(event)
                one = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
                yield sse({**top, "choices": [one]})
            if a.usage_in_stream:
                yield sse(
                    {**top, "choices": [], "usage": usage(tokens_in, sum(c.out for c in choices))}
                )
            yield DONE
            how = ",".join(sorted({c.finish or "cancelled" for c in choices}))
        finally:
            done(how)

    return StreamingResponse(stream(), media_type="text/event-stream")
