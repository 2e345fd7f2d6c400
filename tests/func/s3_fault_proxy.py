"""An HTTP proxy between a client and a test object store (S3, GCS, Azure) that loses the
answers to writes.

Every request is forwarded to the server unchanged (method, path and query, headers, the body
byte for byte: a ``Transfer-Encoding: chunked`` or aws-chunked body travels still chunked) and
the server's answer is relayed, on a keep-alive connection. Rules make a write's outcome
*uncertain* to the client while it really lands on the server:

* ``drop_next_put(part, n)``: the next ``n`` PUTs (or POSTs: a GCS upload) whose path contains
  ``part`` are forwarded,
  the server's whole answer is read, and then the client's connection is closed (or reset)
  without a byte of it;
* ``fail_next_put(part, n, status=503)``: the same, but the client gets a 5xx instead;
* ``refuse_next_put(part, n, status=503)``: the client gets a 5xx and nothing is forwarded (a
  store that takes no write: the outcome is certain to the server, never to the client).

A rule may also look at the request body (``body=``, a substring of it, decoded if chunked), to
pick one transition among many writes of one key.

``Proxy.log`` records what passed through (method, path, status the server gave, the fault,
the request body of PUTs), so a test can tell a PUT reached the server and what it said.
Standard library only; one upstream connection per request keeps the relaying simple.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP = frozenset("connection keep-alive proxy-connection te trailer upgrade expect".split())


@dataclass
class Passed:
    """One request as it went through: what the server answered and what the client got."""

    method: str
    path: str
    status: int  # the server's status
    fault: str = ""  # "", "close", "reset" or the status the client got instead
    body: bytes = b""  # request bodies (decoded when chunked); none for a GET

    @property
    def key(self) -> str:
        return urllib.parse.urlsplit(self.path).path


@dataclass
class _Rule:
    part: str
    left: int
    fault: str  # "close", "reset" or a status code as text
    body: bytes = b""
    forward: bool = True  # False: answered here, the server never sees the write


@dataclass
class Proxy:
    """A running proxy: ``url`` is its endpoint; rules and the log are thread-safe."""

    upstream: str
    url: str = ""
    log: list[Passed] = field(default_factory=list)
    _rules: list[_Rule] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _server: ThreadingHTTPServer | None = None

    def drop_next_put(self, part: str, n: int = 1, how: str = "close", body: bytes = b"") -> None:
        """Land the next ``n`` PUTs whose path contains ``part`` (and body ``body``); give no
        answer (``how``: ``close`` the connection, or ``reset`` it with an RST)."""
        assert how in ("close", "reset")
        with self._lock:
            self._rules.append(_Rule(part, n, how, body))

    def fail_next_put(self, part: str, n: int = 1, status: int = 503, body: bytes = b"") -> None:
        """Land the next ``n`` PUTs whose path contains ``part`` (and body ``body``); answer
        ``status`` instead."""
        with self._lock:
            self._rules.append(_Rule(part, n, str(status), body))

    def refuse_next_put(self, part: str, n: int = 1, status: int = 503, body: bytes = b"") -> None:
        """Answer the next ``n`` PUTs whose path contains ``part`` (and body ``body``) with
        ``status`` without forwarding them: they never land."""
        with self._lock:
            self._rules.append(_Rule(part, n, str(status), body, forward=False))

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def pending(self) -> int:
        """Faults not yet applied."""
        with self._lock:
            return sum(r.left for r in self._rules)

    def puts(self, part: str = "") -> list[Passed]:
        """The PUTs that reached the server whose path contains ``part``, in order."""
        with self._lock:
            return [p for p in self.log if p.method == "PUT" and part in p.path]

    def writes(self, part: str = "", body: bytes = b"") -> list[Passed]:
        """The PUTs and POSTs (GCS uploads) that reached the server whose path contains
        ``part`` and whose body contains ``body``, in order."""
        with self._lock:
            return [
                p
                for p in self.log
                if p.method in ("PUT", "POST") and part in p.path and body in p.body
            ]

    def _fault(self, method: str, path: str, body: bytes) -> tuple[str, bool]:
        """The fault for this request ("" for none) and whether it is forwarded."""
        if method not in ("PUT", "POST"):  # a GCS upload is a POST naming its object in the body
            return "", True
        key = urllib.parse.urlsplit(path).path
        with self._lock:
            for rule in self._rules:
                if rule.left > 0 and rule.part in key and rule.body in body:
                    rule.left -= 1
                    return rule.fault, rule.forward
        return "", True

    def _record(self, passed: Passed) -> None:
        with self._lock:
            self.log.append(passed)

    def start(self) -> Proxy:
        target = urllib.parse.urlsplit(self.upstream)
        proxy = self

        class Handler(_Handler):
            host, port, owner = target.hostname, target.port, proxy

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(
            target=self._server.serve_forever, name="s3-fault-proxy", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


def _read_chunked(rfile) -> tuple[bytes, bytes]:
    """A chunked body as it came (``raw``, to forward) and its decoded payload."""
    raw, data = bytearray(), bytearray()
    while True:
        line = rfile.readline(65537)
        raw += line
        size = int(line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            break
        chunk = rfile.read(size + 2)  # the chunk and its CRLF
        raw += chunk
        data += chunk[:size]
    while True:  # trailers (an aws-chunked checksum may be one), up to the empty line
        line = rfile.readline(65537)
        raw += line
        if line in (b"\r\n", b"\n", b""):
            return bytes(raw), bytes(data)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as s3fs expects of S3
    host: str
    port: int
    owner: Proxy

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        pass

    def _relay(self) -> None:
        method = self.command
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raw, body = _read_chunked(self.rfile)
        else:
            raw = body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        fault, forward = self.owner._fault(method, self.path, body)
        if forward:
            status, headers, data = self._forward(method, raw)
        else:  # refused here: the server never saw it (status 0 in the log)
            status, headers, data = 0, [], b""
        passed = Passed(method, self.path, status, fault, body if method != "GET" else b"")
        self.owner._record(passed)
        if fault in ("close", "reset"):
            if fault == "reset":  # an RST rather than a FIN: linger 0, closed at once
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                )
                self.connection.close()
            self.close_connection = True
            return
        if fault:
            status = int(fault)
            data = (
                b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>ServiceUnavailable'
                b"</Code><Message>injected by the test proxy after the write landed</Message>"
                b"</Error>"
            )
            headers = [("Content-Type", "application/xml")]
        self.send_response_only(status)
        for name, value in headers:
            if name.lower() not in ("transfer-encoding", "content-length"):
                self.send_header(name, value)
        if method == "HEAD":  # no body; the length is the object's
            length = [v for k, v in headers if k.lower() == "content-length"]
            self.send_header("Content-Length", length[0] if length else "0")
        else:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()

    def _forward(self, method: str, raw: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
        """Send the request on to the server: its status, headers (hop-by-hop ones left out)
        and body."""
        up = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            up.putrequest(method, self.path, skip_host=True, skip_accept_encoding=True)
            for name, value in self.headers.items():
                if name.lower() not in HOP:  # the request's Expect was answered here already
                    up.putheader(name, value)
            up.endheaders(raw or None)
            resp = up.getresponse()
            data = resp.read()
            return resp.status, [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP], data
        finally:
            up.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay


def start(upstream: str) -> Proxy:
    """A proxy in front of ``upstream`` (``http://host:port``), already serving."""
    return Proxy(upstream).start()
