"""The engine loop (``run``, on the main thread): one ``runner.serve(take)`` for every request.

``submit`` queues a request's ``Row``s (at most ``max_rows`` run at once, the rest wait) and
returns an ``asyncio.Queue`` of ``(row index, event)``: ``("prompt", [Token])`` (echo),
``("text", str, [Piece])``, ``("done", str, [Piece], Generation)`` once, or ``("error", str)``.
A row ends at its next token once ``cancel()``ed (its client left) or its text met a stop
string. ``stop(grace)`` takes no more rows, refuses the waiting ones, cuts the running ones
``grace`` seconds later.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from spill.console import note
from spill.engines.base import GenerateParams, Generation, Request, Runner, Token
from spill.serve.text import Text

WAITING_MAX = 1024  # rows that may wait for a place before new ones are refused (429)


class Refused(Exception):
    """A row the batcher cannot take now; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(eq=False)
class Row:
    """One generation as the HTTP side asks for it."""

    prompt: np.ndarray  # (n,) int64, n >= 1
    params: GenerateParams
    text: Text
    seed: int = 0
    adapter: str | None = None
    logprobs: int | None = None
    echo: bool = False
    cancelled: bool = field(default=False, init=False)
    emit: Callable[[tuple], None] = field(default=lambda event: None, init=False, repr=False)

    def cancel(self) -> None:
        """End the row at its next token (or drop it before it starts): the client left."""
        self.cancelled = True


def _emitter(loop: asyncio.AbstractEventLoop, events: asyncio.Queue, i: int):
    def emit(event: tuple) -> None:
        try:
            loop.call_soon_threadsafe(events.put_nowait, (i, event))
        except RuntimeError:  # the event loop closed (the server stopped): nobody listens
            pass

    return emit


class Batcher:
    def __init__(self, runner: Runner, max_rows: int) -> None:
        self.runner, self.max_rows = runner, max_rows
        self._waiting: deque[Row] = deque()
        self._running: set[Row] = set()  # touched by the engine thread only
        self._cond = threading.Condition()
        self._stopping = False
        self._cutting = False  # the grace after stop() is over: every running row ends
        self.failed: str | None = None  # why the engine loop died, if it did

    def submit(self, rows: list[Row], loop: asyncio.AbstractEventLoop) -> asyncio.Queue:
        """Queue ``rows`` (one request's choices, all or none); their events arrive on the
        returned queue as ``(index in rows, event)`` (see the module doc)."""
        events: asyncio.Queue = asyncio.Queue()
        for i, row in enumerate(rows):
            row.emit = _emitter(loop, events, i)
        with self._cond:
            if self.failed is not None:
                raise Refused(500, f"the engine stopped ({self.failed}); restart spill serve")
            if self._stopping:
                raise Refused(503, "the server is shutting down; send the request elsewhere")
            if len(self._waiting) + len(rows) > WAITING_MAX:
                raise Refused(429, f"{WAITING_MAX} requests are waiting already; retry later")
            self._waiting.extend(rows)
            self._cond.notify()
        return events

    def stop(self, grace: float) -> None:
        """Take no more rows; refuse the waiting ones; cut the running ones after ``grace`` s."""
        with self._cond:
            if self._stopping:
                return
            self._stopping = True
            left, self._waiting = list(self._waiting), deque()
            self._cond.notify()
        for row in left:
            row.emit(("error", "the server is shutting down before this request started"))
        timer = threading.Timer(grace, self.cut)
        timer.daemon = True
        timer.start()

    @property
    def load(self) -> tuple[int, int]:
        """(rows running, rows waiting), for /health."""
        return len(self._running), len(self._waiting)

    def cut(self) -> None:
        """End every running row at its next token (``finish`` "cancelled")."""
        self._cutting = True

    # --- the engine thread ------------------------------------------------------------------

    def _take(self, idle: bool) -> list[Request] | None:
        with self._cond:
            while idle and not self._waiting and not self._stopping:
                self._cond.wait(1.0)  # a signal's handler runs on this (the main) thread
            if self._stopping:
                return None
            out = []
            while self._waiting and len(self._running) + len(out) < self.max_rows:
                row = self._waiting.popleft()
                if not row.cancelled:  # its client left while it waited
                    out.append(row)
        self._running.update(out)
        return [self._request(row) for row in out]

    def _request(self, row: Row) -> Request:
        def on_token(token: Token) -> bool:
            new, pieces = row.text.add(token)
            if new or pieces:
                row.emit(("text", new, pieces))
            return row.cancelled or row.text.stopped or self._cutting

        def on_done(gen: Generation) -> None:
            self._running.discard(row)
            new, pieces = row.text.finish()
            row.emit(("done", new, pieces, gen))

        return Request(
            prompt=row.prompt,
            params=row.params,
            seed=row.seed,
            adapter=row.adapter,
            logprobs=row.logprobs,
            echo=row.echo,
            on_prompt=(lambda tokens: row.emit(("prompt", tokens))) if row.echo else None,
            on_token=on_token,
            on_done=on_done,
        )

    def run(self) -> None:
        """The engine loop, on the calling thread, until ``stop`` and the running rows end (or
        the engine fails). Call it on the main thread: torch computes 2-4x slower on another
        (SmolLM2's decode, 2 OpenMP threads: 87 tokens/s on the main thread, 35 on another)."""
        try:
            self.runner.serve(self._take)
        except Exception as e:  # every row still open hears of it; new ones are refused
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
            with self._cond:
                self.failed = why
                rows, self._waiting = [*self._running, *self._waiting], deque()
            self._running.clear()
            for row in rows:
                row.emit(("error", f"the engine stopped ({why})"))
            note(f"spill serve: error: the engine stopped: {why}")
