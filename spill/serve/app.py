"""The application: OpenAI's routes on FastAPI over one batcher, and errors in OpenAI's shape.

Routes: ``GET /health`` (no key needed), ``GET /v1/models``, ``POST /v1/completions``
(``spill.serve.completions``), ``POST /v1/chat/completions`` (``spill.serve.chat``). Every
refusal is OpenAI's error JSON with one sentence (an unknown route 404, a wrong method 405);
a failure of a route is a 500 with one line, logged on stderr, never a trace.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from spill.console import note
from spill.serve.api import Api
from spill.serve.batcher import Batcher
from spill.serve.chat import chat_completions
from spill.serve.completions import completions
from spill.serve.open import Served
from spill.serve.parse import ApiError


def make_app(served: Served, batcher: Batcher, key: str | None) -> FastAPI:
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    api = Api(served, batcher, key)

    @app.exception_handler(ApiError)
    async def refused(request: Request, e: ApiError):
        note(f"spill serve: {request.method} {request.url.path} · {e.status} · {e.message}"[:300])
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        error = ApiError(e.status_code, f"{request.method} {request.url.path}: {e.detail}")
        note(f"spill serve: {error.message[:200]} · {e.status_code}")
        return JSONResponse(error.body(), e.status_code)

    async def guarded(route, request: Request):
        """The route's answer; a failure of spill's own is a 500 in one line, not a trace
        (Starlette's handler for Exception would log one after answering)."""
        try:
            return await route(api, request)
        except ApiError:
            raise
        except Exception as e:
            line = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            note(f"spill serve: error: {request.method} {request.url.path}: {line}")
            raise ApiError(500, f"the server failed ({line})", None, "server_error",
                           "server_error") from None  # fmt: skip

    @app.get("/health")
    async def health():
        running, waiting = batcher.load
        if batcher.failed is not None:
            return JSONResponse({"status": "failed", "error": batcher.failed}, 503)
        return {"status": "ok", "running": running, "waiting": waiting}

    @app.get("/v1/models")
    async def models(request: Request):
        api.check_key(request)
        names = [served.name, *served.adapters]
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "spill"} for n in names]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def complete(request: Request):
        return await guarded(completions, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await guarded(chat_completions, request)

    return app
