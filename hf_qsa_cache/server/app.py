"""The HTTP app: OpenAI's chat completions, completions and responses routes on our continuous-batching engine.

Each HTTP request is checked whole before anything is queued: its fields (`schemas`), its model (only the one
served), its prompt (the chat template, media), its limits (body size, prompt length, ``max_tokens``, ``n``,
stop strings). A bad one gets a 4xx and changes nothing. Then each of its ``n`` choices is one engine request
with its own sampling parameters and seed (``seed + i``), delivered to its own handler. A client that goes away
cancels its requests at once (their rows are free before the engine's next step). A request that fails fails
alone: the server goes on. A dead engine answers 503, on `/health` too.

The engine is an `engine_process.EngineProcess` (the model and its manager in a process of their own: what
`hf-qsa-serve` runs) or an `engine.Engine` (in this process), behind the same interface; this process needs only
the checkpoint's config, generation config and tokenizer.

Where things live: this module wires the app (startup and shutdown, the API key and body size guard, errors as
JSON); `served` what it serves and its limits; `checks` a request body checked and turned into engine arguments;
`runs` the engine requests of one HTTP request, whole or streamed; `routes_chat`, `routes_completions`,
`routes_responses` and `routes_server` (health, models, load_model, reset) the routes.
"""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from . import routes_chat, routes_completions, routes_responses, routes_server
from .engine import EngineDead
from .errors import error_response
from .prompts import BadRequest
from .served import Limits, Served

__all__ = ["Limits", "Served", "build_app"]

logger = logging.getLogger(__name__)


def build_app(served: Served, enable_cors: bool = False, start_engine: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        if start_engine:
            served.engine.start()  # already started by the command: attaches a process engine to this loop
        try:
            yield
        finally:
            cancelled = len(served.engine.inflight)
            served.engine.stop(timeout=2)
            if cancelled:
                logger.warning("shutdown: cancelled %d request(s) still running", cancelled)
            logger.warning("shutdown: the engine stopped")

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.served = served  # the routes find it here (`served.served_of`)

    if enable_cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(Guard, served=served)

    @app.exception_handler(BadRequest)
    async def _bad(_request, error: BadRequest):
        return error_response(error.status, error.message, error.param, error.code)

    @app.exception_handler(EngineDead)
    async def _dead(_request, error: EngineDead):
        return error_response(503, str(error), code="engine_unavailable")

    @app.exception_handler(Exception)
    async def _unexpected(_request, error: Exception):
        logger.error("request failed: %s", error, exc_info=True)
        return error_response(500, f"internal error: {type(error).__name__}: {error}")

    for module in (routes_server, routes_chat, routes_completions, routes_responses):
        app.include_router(module.router)
    return app


def refusal(served: Served, request: Request) -> JSONResponse | None:
    """The answer to a request that may not reach a route (a missing or wrong API key, a body over the limit),
    else None."""
    if served.api_key is not None and request.url.path != "/health" and request.method != "OPTIONS":
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), served.api_key.encode()):
            response = error_response(401, "a valid API key is needed: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            return error_response(400, "bad Content-Length header")
        if int(length) > served.limits.max_body_bytes:
            return error_response(413, f"the request body has {length} bytes, more than the limit "
                                       f"{served.limits.max_body_bytes}")
    return None


class Guard:
    """`refusal` before any route, as a plain ASGI middleware: Starlette's ``@app.middleware("http")`` relays
    every chunk of a streamed response through a memory stream, a cost per token and stream that the engine
    thread pays too (one interpreter lock)."""

    def __init__(self, app, served: Served):
        self.inner = app
        self.served = served

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            response = refusal(self.served, Request(scope))
            if response is not None:
                await response(scope, receive, send)
                return
        await self.inner(scope, receive, send)
