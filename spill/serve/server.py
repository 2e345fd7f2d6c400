"""Running the server: the engine thread, uvicorn on a bound socket, and a clean stop.

Only a loopback host is served without an API key. Port 0 binds a free port; either way
``serving on http://HOST:PORT`` goes to stderr once the socket listens. SIGTERM or SIGINT:
no new requests (uvicorn stops listening; requests already queued but not started are
answered 503), running rows finish, those still running after the preemption grace
(``SPILL_PREEMPT_GRACE``, 15 s) are cut, and the process exits 0 within the deadline
(``SPILL_PREEMPT_DEADLINE``, 30 s), as jobs do (``spill.jobs.preempt``).
"""

from __future__ import annotations

import ipaddress
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import uvicorn

from spill.console import note
from spill.errors import UsageError
from spill.jobs.preempt import Guard
from spill.serve import KEY_ENV
from spill.serve.app import make_app
from spill.serve.batcher import Batcher
from spill.serve.open import Served


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_host(host: str, key: str | None) -> None:
    if key is None and not is_loopback(host):
        raise UsageError(
            f"--host {host} is not a loopback address: serving it needs an API key "
            f"(--api-key KEY or {KEY_ENV}), or keep the default 127.0.0.1"
        )


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise UsageError(
            f"cannot listen on {host}:{port} ({e.strerror}); pick another --port"
        ) from None
    sock.listen(2048)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server on a thread of its own: the main thread computes (``Batcher.run``) and
    takes the signals, telling the batcher and this server to stop; uvicorn neither installs
    handlers nor raises the signal again once stopped (which would end the process by it)."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[str], None]) -> None:
        super().__init__(config)
        self.on_stop = on_stop

    def handle_exit(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        threading.Thread(target=self.on_stop, args=(name,), daemon=True).start()  # takes locks
        super().handle_exit(sig, frame)

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the main thread's handlers (``serve``) call handle_exit

    @contextmanager
    def signals(self) -> Iterator[None]:
        """SIGINT and SIGTERM stop the server, on the main thread, for the block."""
        before = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for s, handler in before.items():
                signal.signal(s, handler)


def serve(served: Served, host: str, port: int, key: str | None, max_rows: int) -> int:
    """Serve until a signal stops the server; 0 once it stopped cleanly."""
    check_host(host, key)
    limits = Guard(signals=())  # the preemption grace and deadline jobs use (env or default)
    grace, deadline = limits.grace, limits.deadline
    batcher = Batcher(served.loaded.runner, max_rows)
    asked: list[float] = []  # when each stop came
    lock = threading.Lock()

    def stop(reason: str) -> None:
        """The first call stops taking rows; a later one (a second signal, or the server's
        end, when no client is left to read them) cuts the running rows at once."""
        with lock:
            first = not asked
            asked.append(time.monotonic())
        if not first:
            batcher.cut()
            return
        note(f"spill serve: {reason}: no new requests; running ones finish or are cut in "
             f"{grace:g} s")  # fmt: skip
        batcher.stop(grace)

    app = make_app(served, batcher, key)
    sock = _bind(host, port)
    config = uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off",
        timeout_graceful_shutdown=max(1, int(deadline - 2)),
    )  # fmt: skip
    server = _Server(config, stop)

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            stop("the server stopped")  # the engine loop ends with it

    names = ", ".join(served.adapters) or "none"
    bound = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    note(f"spill serve: {served.name} · adapters {names} · up to {max_rows} rows at once")
    with server.signals():
        web = threading.Thread(target=http, name="spill-serve-http", daemon=True)
        web.start()
        note(f"serving on http://{shown}:{bound}")
        batcher.run()  # the engine, on this thread, until a stop and the rows end
        while web.is_alive():  # an engine that failed leaves the server answering 500s
            web.join(0.5)
    sock.close()
    served.loaded.runner.close()  # the engine loop ended on this thread
    note("spill serve: stopped")
    return 0
