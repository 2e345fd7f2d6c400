"""A real headless Chromium for the report tests, driven over the DevTools protocol.

``open_page`` starts Chromium with ``--remote-debugging-pipe`` (the protocol as NUL-separated
JSON on file descriptors 3 and 4: no websocket client, no port), opens a page in a new target
with the Network domain on, waits for its load event, and returns every request the page made
(``Network.requestWillBeSent``), its DOM after rendering and a PNG screenshot. ``png_pixels``
decodes that PNG with zlib alone (8-bit RGB or RGBA, the five filters), so counting colors
needs no Pillow.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import struct
import subprocess
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any, NamedTuple

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def chromium() -> str | None:
    """The Chromium (or Chrome) binary on PATH, or $SPILL_TEST_CHROMIUM."""
    given = os.environ.get("SPILL_TEST_CHROMIUM")
    return given or next(filter(None, (shutil.which(n) for n in NAMES)), None)


class Page(NamedTuple):
    requests: list[str]  # the URL of each request the page made, in order
    dom: str  # document.documentElement.outerHTML after load
    png: bytes  # a screenshot of the whole page


class _Pipe:
    def __init__(self, binary: str, profile: str):
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                 "--remote-debugging-pipe", f"--user-data-dir={profile}", "--no-first-run",
                 "--disable-extensions", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "about:blank"]  # fmt: skip
        # fd 3 is what Chromium reads commands from, fd 4 where it writes answers and events
        script = 'exec "$0" "$@" 3<&0 4>&1 0</dev/null 1>/dev/null'
        self.proc = subprocess.Popen(
            ["sh", "-c", script, binary, *flags],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.buf, self.next_id, self.events = b"", 0, []

    def _read(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self.buf:
            if time.monotonic() > deadline:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed its DevTools pipe")
            self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, session: str | None = None, timeout: float = 30, **params):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        self.proc.stdin.write(json.dumps(msg).encode() + b"\0")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            got = self._read(deadline)
            if got.get("id") == self.next_id:
                if "error" in got:
                    raise RuntimeError(f"{method}: {got['error']}")
                return got.get("result", {})
            self.events.append(got)

    def wait_for(self, method: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        for i, e in enumerate(self.events):
            if e.get("method") == method:
                return self.events.pop(i)
        while True:
            got = self._read(deadline)
            if got.get("method") == method:
                return got
            self.events.append(got)

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # our own child, by its handle
            self.proc.wait()


def open_page(
    binary: str, url: str, width: int = 1100, scale: float = 0.4, settle_s: float = 0.5
) -> Page:
    """Load ``url`` in a fresh headless Chromium and record what it requested; the screenshot
    is of the whole page at ``scale``."""
    with tempfile.TemporaryDirectory(prefix="spill-chromium-") as profile:
        pipe = _Pipe(binary, profile)
        try:
            target = pipe.call("Target.createTarget", url="about:blank")["targetId"]
            session = pipe.call("Target.attachToTarget", targetId=target, flatten=True)
            sid = session["sessionId"]
            pipe.call("Network.enable", sid)
            pipe.call("Page.enable", sid)
            pipe.call("Emulation.setDeviceMetricsOverride", sid, width=width, height=900,
                      deviceScaleFactor=1, mobile=False)  # fmt: skip
            pipe.call("Page.navigate", sid, url=url)
            pipe.wait_for("Page.loadEventFired")
            time.sleep(settle_s)  # anything a page would fetch late shows up too
            dom = pipe.call(
                "Runtime.evaluate", sid, expression="document.documentElement.outerHTML"
            )
            size = pipe.call("Page.getLayoutMetrics", sid)["cssContentSize"]
            clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"]}
            shot = pipe.call("Page.captureScreenshot", sid, format="png",
                             captureBeyondViewport=True, clip={**clip, "scale": scale})  # fmt: skip
            pipe.call("Runtime.evaluate", sid, expression="1")  # drain events sent meanwhile
            requests = [
                e["params"]["request"]["url"]
                for e in pipe.events
                if e.get("method") == "Network.requestWillBeSent" and e.get("sessionId") == sid
            ]
        finally:
            pipe.close()
    return Page(requests, dom["result"]["value"], base64.b64decode(shot["data"]))


def png_pixels(data: bytes) -> tuple[int, int, list[bytes]]:
    """(width, height, pixels as bytes of 3 or 4) of an 8-bit RGB or RGBA PNG: read by Pillow
    where it is installed, else decoded here."""
    try:
        from PIL import Image
    except ImportError:
        return _decode(data)
    import io

    img = Image.open(io.BytesIO(data)).convert("RGBA")
    raw = img.tobytes()
    return img.width, img.height, [raw[i : i + 4] for i in range(0, len(raw), 4)]


def _decode(data: bytes) -> tuple[int, int, list[bytes]]:
    """The PNG decoder for where there is no Pillow."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    at, idat, head = 8, b"", None
    while at < len(data):
        (n,), kind = struct.unpack(">I", data[at : at + 4]), data[at + 4 : at + 8]
        body = data[at + 8 : at + 8 + n]
        if kind == b"IHDR":
            head = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        at += 12 + n
    w, h, depth, ctype, _, _, interlace = head
    assert depth == 8 and ctype in (2, 6) and not interlace, head
    bpp = 3 if ctype == 2 else 4
    raw, stride, prev, pixels = zlib.decompress(idat), w * bpp, bytearray(w * bpp), []
    for y in range(h):
        f, line = (
            raw[y * (stride + 1)],
            bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)]),
        )
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else b if pb <= pc else c
                line[i] = (line[i] + pred) & 255
        pixels += [bytes(line[i : i + bpp]) for i in range(0, stride, bpp)]
        prev = line
    return w, h, pixels


def file_url(path: Path) -> str:
    return path.resolve().as_uri()
