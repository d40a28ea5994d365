"""The OpenAI-compatible HTTP server (FastAPI): ``create_app(engine)``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /metrics`` (Prometheus). Handlers never touch the engine: they hand
work to the :class:`EngineLoop` thread and await its futures. The loop starts and stops with
the app's lifespan (``uvicorn``, or ``with TestClient(app)``).

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: bad input is
a 400 ``invalid_request_error`` naming the field, the value and what is allowed (other
requests are unaffected); an engine failure is a 500 ``server_error`` with its message.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvcanary.engine.engine import Engine
from kvcanary.server.engine_loop import EngineLoop, InvalidRequestError
from kvcanary.server.metrics import make_server_registry
from kvcanary.server.protocol import (
    BadRequest,
    chat_response,
    completion_response,
    engine_error,
    error_body,
    parse_chat,
    parse_completion,
)


class EngineFailure(RuntimeError):
    """The engine (or its loop) failed this request: an HTTP 500 with the message."""


def create_app(engine: Engine, served_model_name: str | None = None) -> FastAPI:
    """An app serving ``engine``, which it owns from now on (through one loop thread)."""
    model = served_model_name or engine.config.model
    loop = EngineLoop(engine)
    registry = make_server_registry(loop)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="kvcanary", lifespan=lifespan)
    app.state.engine_loop = loop

    @app.exception_handler(BadRequest)
    async def _bad_request(_: Request, e: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(e.message, "invalid_request_error", e.param), status_code=400)

    @app.exception_handler(EngineFailure)
    async def _engine_failure(_: Request, e: EngineFailure) -> JSONResponse:
        return JSONResponse(error_body(str(e), "server_error"), status_code=500)

    @app.exception_handler(Exception)  # a server bug: answered in the same shape, and logged
    async def _server_error(_: Request, e: Exception) -> JSONResponse:
        message = f"{type(e).__name__}: {e}"
        return JSONResponse(error_body(message, "server_error"), status_code=500)

    async def generate(body: Any, parse: Callable[[Any, str], Any]) -> Any:
        req = parse(body, model)
        try:
            return await asyncio.wrap_future(loop.submit(req.prompt, req.params))
        except InvalidRequestError as e:
            raise engine_error(e.cause) from None
        except Exception as e:  # noqa: BLE001 -- the engine's failure, reported to the client
            raise EngineFailure(f"{type(e).__name__}: {e}") from e

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        out = await generate(await _json_body(request), parse_completion)
        return completion_response(out, model)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> dict[str, Any]:
        out = await generate(await _json_body(request), parse_chat)
        return chat_response(out, model)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model, "object": "model", "created": created, "owned_by": "kvcanary",
                "max_model_len": engine.runner.max_context_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if loop.alive:
            return JSONResponse({"status": "ok"})
        why = f"{type(loop.error).__name__}: {loop.error}" if loop.error else "engine loop not running"
        return JSONResponse({"status": "error", "message": why}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        scrape = lambda: generate_latest(registry)  # noqa: E731
        # A dead loop's engine is idle for good: reading it from here is safe then.
        text = await asyncio.wrap_future(loop.call(scrape)) if loop.alive else scrape()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
