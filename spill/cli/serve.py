"""``spill serve [MODEL | PROJECT_DIR]``: an OpenAI-compatible HTTP server (``spill.serve``).

Requests on the base model and on every adapter share one running batch. Binds 127.0.0.1 by
default; another host only with an API key. SIGTERM or Ctrl-C stops it cleanly (exit 0).
"""

from __future__ import annotations

import os
from pathlib import Path

from spill.cli.options import engine_options, engine_settings, model_options, model_settings
from spill.errors import UsageError
from spill.serve import KEY_ENV

HELP = "serve a model and its adapters over OpenAI's HTTP API (completions, chat, streaming)"


def _adapters(given: list[str] | None) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for text in given or []:
        name, sep, folder = text.partition("=")
        if not sep or not name or not folder:
            raise UsageError(f"--adapter {text!r}: give NAME=DIR (an adapter folder and its name)")
        if name in out:
            raise UsageError(f"--adapter {name} is given twice; give each name once")
        out[name] = Path(folder)
    return out


def cmd_serve(args) -> int:
    from spill.models.quant import spec_of
    from spill.serve.open import open_served

    try:
        from spill.serve.server import check_host, serve
    except ModuleNotFoundError as e:
        raise UsageError(
            f"spill serve needs {e.name}: pip install 'streamweights[serve]'"
        ) from None

    key = args.api_key if args.api_key is not None else os.environ.get(KEY_ENV)
    if key is not None and not key.strip():
        raise UsageError(f"the API key is empty; give --api-key KEY or {KEY_ENV} with a value")
    if args.max_rows < 1:
        raise UsageError("--max-rows must be at least 1")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} is no TCP port; give 0 to 65535 (0: a free one)")
    check_host(args.host, key)  # before the model loads
    if args.target is None:
        from spill.project.sources import FILE

        if not Path(FILE).is_file():
            raise UsageError(f"no {FILE} here: give a MODEL or a project folder to serve")
        args.target = "."
    adapters = _adapters(args.adapter)
    args.model = args.target  # what model_settings names
    quantize = spec_of(model_settings(args))
    served = open_served(args.target, adapters, engine_settings(args), args.weights, quantize)
    return serve(served, args.host, args.port, key, args.max_rows)


def add_parser(sub, full: bool = True) -> None:
    """``full=False`` (another verb runs): the name and help only, no conf defaults read."""
    if not full:
        sub.add_parser("serve", help=HELP)
        return
    p = sub.add_parser(
        "serve",
        help=HELP,
        description="Serve MODEL (alias, hub id, local folder) or a built project (its model "
        "and its adapters under .spill/adapters/, by name) over OpenAI's HTTP API: "
        "/v1/models, /v1/completions, /v1/chat/completions (streamed or not, with log-probs), "
        "/health. A request's model field picks the base model or an adapter; concurrent "
        "requests share one running batch. See docs/serve.md.",
    )
    p.add_argument("target", nargs="?", metavar="MODEL | PROJECT_DIR",
                   help="a model, or a project folder (default: the current folder)")  # fmt: skip
    p.add_argument("--adapter", action="append", metavar="NAME=DIR",
                   help="serve an adapter folder under NAME (repeat for more)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (127.0.0.1; another needs an API key)")  # fmt: skip
    p.add_argument("--port", type=int, default=8000, help="TCP port (8000; 0: a free one)")
    p.add_argument("--api-key", metavar="KEY",
                   help=f"require Authorization: Bearer KEY (or set {KEY_ENV})")  # fmt: skip
    p.add_argument("--max-rows", type=int, default=16, metavar="N",
                   help="requests generating at once; the rest wait (16)")  # fmt: skip
    engine_options(p)
    model_options(p)
    p.set_defaults(func=cmd_serve)
