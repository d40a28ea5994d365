"""Every error the server answers, in OpenAI's shape (see :mod:`kvcanary.server.app`'s
table): the exception types handlers raise, and the handlers FastAPI calls for them and for
its own errors (404, 405, 422) and for bugs (500)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvcanary.server.protocol import BadRequest, error_body


class HTTPError(Exception):
    """Any non-400 error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.headers = headers


class EngineFailure(HTTPError):
    """The engine (or its loop) failed this request: an HTTP 500 with the message."""

    def __init__(self, message: str) -> None:
        super().__init__(500, message, "server_error")


def too_large(num_bytes: int, limit: int) -> dict[str, Any]:
    return error_body(f"the request body has {num_bytes} bytes: allowed at most {limit}",
                      "invalid_request_error", code="request_too_large")  # fmt: skip


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(BadRequest)
    async def _bad_request(_: Request, e: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(e.message, "invalid_request_error", e.param), status_code=400)

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, e: HTTPError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.type, code=e.code), status_code=e.status,
                            headers=e.headers)  # fmt: skip

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, e: StarletteHTTPException) -> JSONResponse:
        where = f"{request.method} {request.url.path}"
        if e.status_code == 404:
            body = error_body(f"{where}: no such endpoint (see /v1/models, /v1/completions, "
                              "/v1/chat/completions, /generate)", "not_found_error",
                              code="not_found")  # fmt: skip
        elif e.status_code == 405:
            allow = {k.lower(): v for k, v in (e.headers or {}).items()}.get("allow", "")
            body = error_body(f"{where}: method not allowed: allowed {allow}", "invalid_request_error",
                              code="method_not_allowed")  # fmt: skip
        else:
            body = error_body(f"{where}: {e.detail}", "invalid_request_error")
        return JSONResponse(body, status_code=e.status_code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        message = f"{param}: {first.get('msg', 'invalid')}" if param else str(first.get("msg", e))
        return JSONResponse(error_body(message, "invalid_request_error", param), status_code=422)

    @app.exception_handler(Exception)  # a server bug: answered in the same shape
    async def _server_error(_: Request, e: Exception) -> JSONResponse:
        message = f"{type(e).__name__}: {e}"
        return JSONResponse(error_body(message, "server_error"), status_code=500)
