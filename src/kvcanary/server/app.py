"""The HTTP server (FastAPI): ``create_app(engine)``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both also streamed as
server-sent events with ``"stream": true``), SGLang's native ``POST /generate``,
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus). Handlers never touch the
engine: they hand work to the :class:`EngineLoop` thread and await its futures (or, when
streaming, its per-step progress). The loop starts and stops with the app's lifespan
(``uvicorn``, or ``with TestClient(app)``).

Every error uses OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``::

    400 invalid_request_error   bad input: names the field, the value and what is allowed
    401 authentication_error    --api-key set and the Bearer token missing or wrong
    404 not_found_error         no such path          405  wrong method (Allow header)
    413 invalid_request_error   body over max_body_bytes
    422 invalid_request_error   a framework-validated parameter is malformed
    500 server_error            the engine failed this request (or a server bug)
    503 server_overloaded       more than max_running_requests + max_queued_requests in
                                flight (Retry-After header)
    503 server_error            code engine_unavailable: the engine loop is down

A client that disconnects aborts its request(s) at any moment (waiting, in a prefill chunk,
retracted, before its first token, mid-stream; streamed or not): the engine frees their KV
before its next step.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvcanary.config import DEFAULT_MAX_QUEUED_REQUESTS
from kvcanary.engine.engine import Engine, RequestOutput
from kvcanary.model.tokenizer import TokenizerUnavailableError
from kvcanary.server import protocol as P
from kvcanary.server import responses as R
from kvcanary.server.engine_loop import (
    EngineLoop,
    EngineLoopStopped,
    InvalidRequestError,
    Progress,
    Submission,
)
from kvcanary.server.errors import EngineFailure, HTTPError, install_error_handlers, too_large
from kvcanary.server.metrics import make_server_registry
from kvcanary.server.protocol import BadRequest, GenerateRequest, error_body

DEFAULT_MAX_BODY_BYTES = 8 << 20
RETRY_AFTER_S = 1
log = logging.getLogger(__name__)
_PROTECTED = ("/v1/", "/generate")  # what --api-key guards (health and metrics stay open)


def create_app(
    engine: Engine,
    served_model_name: str | None = None,
    *,
    api_key: str | None = None,
    max_queued_requests: int = DEFAULT_MAX_QUEUED_REQUESTS,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    warmup: Callable[[], Any] | None = None,
) -> FastAPI:
    """An app serving ``engine``, which it owns from now on (through one loop thread).

    ``api_key``: clients must send ``Authorization: Bearer <api_key>``. At most
    ``max_running_requests + max_queued_requests`` requests (``n`` counts each copy) are in
    flight; more get a 503. Bodies over ``max_body_bytes`` get a 413.

    ``warmup``: run on a thread of its own when the server starts (``kvcanary serve``: compile
    every kernel the engine calls, :func:`kvcanary.engine.warmup.warm_engine`); until it returns,
    ``/health`` answers 503 ``{"status": "starting"}``, generation requests get a 503 with
    Retry-After (bad ones still their 400), and the engine loop has not started, so no
    request ever waits on a compile. A warm-up that raises is logged and the server starts
    anyway (its kernels then compile at first use)."""
    if max_queued_requests < 0:
        raise ValueError(f"--max-queued-requests={max_queued_requests} is invalid: allowed an integer >= 0")
    if api_key is not None and not api_key:
        raise ValueError('--api-key="" is invalid: allowed a non-empty string')
    model = served_model_name or engine.config.model
    loop = EngineLoop(engine)
    registry = make_server_registry(loop)
    created = int(time.time())
    capacity = engine.config.max_running_requests + max_queued_requests
    decode = engine.tokenizer.decode

    ready, closing = threading.Event(), threading.Event()

    def start() -> None:
        try:
            if warmup is not None:
                warmup()
        except Exception:  # never keep the server down for the warm-up's sake
            log.exception("kvcanary serve: warm-up failed; kernels compile at first use")
        finally:
            if not closing.is_set():  # (a server stopped mid-warm-up never starts its loop)
                loop.start()
                ready.set()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if warmup is None:
            start()
        else:
            threading.Thread(target=start, name="kvcanary-warmup", daemon=True).start()
        try:
            yield
        finally:
            closing.set()
            await asyncio.to_thread(loop.stop)

    app = FastAPI(title="kvcanary", lifespan=lifespan)
    app.state.engine_loop = loop

    install_error_handlers(app)

    @app.middleware("http")
    async def _guard(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if api_key is not None and request.url.path.startswith(_PROTECTED):
            auth = request.headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if not (scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())):
                body = error_body("invalid or missing API key: send the header "
                                  "'Authorization: Bearer <key>' with the server's --api-key",
                                  "authentication_error", code="invalid_api_key")  # fmt: skip
                return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > max_body_bytes:
            return JSONResponse(too_large(int(length), max_body_bytes), status_code=413)
        return await call_next(request)

    # ------------------------------------------------------------------ requests
    def admit(req: GenerateRequest) -> None:
        n = req.n
        if not ready.is_set():
            # The loop has not started: the engine is this thread's to check requests
            # against, so a bad one gets its 400 now, not a 503 and a 400 on retry.
            try:
                for params in req.copies():
                    engine.check_request(req.prompt, params)
            except (ValueError, TokenizerUnavailableError) as e:
                raise P.engine_error(e) from None
            raise HTTPError(503, "server starting: compiling kernels (first start; cached "
                            f"afterwards); retry after {RETRY_AFTER_S} s", "server_error",
                            "server_starting", {"Retry-After": str(RETRY_AFTER_S)})  # fmt: skip
        if not loop.alive:
            raise HTTPError(503, f"the engine loop is not running: {loop.error or 'stopped'}",
                            "server_error", "engine_unavailable")  # fmt: skip
        if loop.num_in_flight + n > capacity:
            raise HTTPError(
                503, f"server overloaded: {loop.num_in_flight} requests in flight, at most "
                f"{capacity} (--max-running-requests {engine.config.max_running_requests} + "
                f"--max-queued-requests {max_queued_requests}); retry after {RETRY_AFTER_S} s",
                "server_overloaded", "server_overloaded", {"Retry-After": str(RETRY_AFTER_S)},
            )  # fmt: skip

    def submissions(req: GenerateRequest, on_progress: Callable[[int], Callable[[Progress], None]] | None
                    ) -> list[Submission]:  # fmt: skip
        subs: list[Submission] = []
        for i, params in enumerate(req.copies()):
            subs.append(Submission(req.prompt, params, req.stop,
                                   on_progress(i) if on_progress else None,
                                   after=subs[0] if subs else None))  # fmt: skip
        return subs

    async def until_gone(request: Request, subs: list[Submission], work: Awaitable[Any]) -> Any:
        """``await work``, unless the client disconnects first: then abort ``subs`` (the
        engine frees their KV before its next step) and answer 499, which nobody reads."""
        task = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:  # a pending receive must not outlive us: a streamed response listens too
            gone.cancel()
        if task.done():
            return task.result()
        task.cancel()
        task.add_done_callback(_consume)  # (a cancelled gather's error is nobody's)
        for s in subs:
            loop.abort(s)
        raise HTTPError(499, "the client closed the request", "invalid_request_error",
                        "client_closed_request")  # fmt: skip

    async def run(req: GenerateRequest, request: Request) -> list[RequestOutput]:
        admit(req)
        subs = submissions(req, None)
        futures = [asyncio.wrap_future(loop.submit(s)) for s in subs]
        try:
            return list(await until_gone(request, subs, asyncio.gather(*futures)))
        except HTTPError:
            raise
        except InvalidRequestError as e:
            raise P.engine_error(e.cause) from None
        except EngineLoopStopped as e:
            raise EngineFailure(str(e)) from e
        except asyncio.CancelledError:
            for s in subs:
                loop.abort(s)
            raise
        except Exception as e:  # noqa: BLE001 -- the engine's failure, reported to the client
            raise EngineFailure(f"{type(e).__name__}: {e}") from e

    async def stream(req: GenerateRequest, request: Request,
                     render: Callable[[int, Progress], list[dict[str, Any]]],
                     finish: Callable[[list[RequestOutput]], list[dict[str, Any]]],
                     opening: list[dict[str, Any]]) -> StreamingResponse:  # fmt: skip
        """Server-sent events: ``opening``, ``render(i, progress)`` per step of choice i,
        ``finish(outputs)`` after the last, then ``[DONE]``. Raises the request's 400 before
        the response starts when the engine rejects it."""
        admit(req)
        aloop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, Progress | BaseException]] = asyncio.Queue()

        def sink(i: int) -> Callable[[Progress], None]:
            def put(p: Progress) -> None:
                aloop.call_soon_threadsafe(events.put_nowait, (i, p))

            return put

        def on_failure(i: int) -> Callable[[Any], None]:
            def done(fut: Any) -> None:
                if fut.exception() is not None:  # a success ended with its last progress
                    aloop.call_soon_threadsafe(events.put_nowait, (i, fut.exception()))

            return done

        subs = submissions(req, sink)
        for i, s in enumerate(subs):
            loop.submit(s).add_done_callback(on_failure(i))
        try:
            first = await until_gone(request, subs, events.get())
        except asyncio.CancelledError:
            for s in subs:
                loop.abort(s)
            raise
        if isinstance(first[1], BaseException):  # failed before its first token: a plain error
            for s in subs:
                loop.abort(s)
            if isinstance(first[1], InvalidRequestError):
                raise P.engine_error(first[1].cause)
            raise EngineFailure(f"{type(first[1]).__name__}: {first[1]}")

        async def body() -> AsyncIterator[str]:
            try:
                for chunk in opening:
                    yield _sse(chunk)
                left, item = len(subs), first
                while True:
                    i, ev = item
                    if isinstance(ev, BaseException):
                        yield _sse(error_body(f"{type(ev).__name__}: {ev}", "server_error"))
                        break
                    for chunk in render(i, ev):
                        yield _sse(chunk)
                    left -= ev.finish_reason is not None
                    if not left:
                        for chunk in finish([s.future.result() for s in subs]):
                            yield _sse(chunk)
                        break
                    item = await events.get()
                yield "data: [DONE]\n\n"
            finally:  # done, or the client went away: free whatever still runs
                for s in subs:
                    loop.abort(s)

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})  # fmt: skip

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> dict[str, Any] | StreamingResponse:
        req = P.parse_completion(await _json_body(request, max_body_bytes), model)
        if not req.stream:
            return R.completion_response(await run(req, request), model, decode)
        chunk = R.stream_chunker("cmpl", "text_completion", model, req.include_usage)
        sent = [0] * req.n

        def render(i: int, p: Progress) -> list[dict[str, Any]]:
            lps = R.completion_logprobs(p.logprobs, decode, sent[i])
            sent[i] += len(p.text)
            return [chunk([{"index": i, "text": p.text, "token_ids": p.token_ids, "logprobs": lps,
                            "finish_reason": p.finish_reason}])]  # fmt: skip

        def finish(outs: list[RequestOutput]) -> list[dict[str, Any]]:
            return [chunk([], usage=R.usage(outs))] if req.include_usage else []

        return await stream(req, request, render, finish, [])

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> dict[str, Any] | StreamingResponse:
        req = P.parse_chat(await _json_body(request, max_body_bytes), model, engine.tokenizer)
        if not req.stream:
            return R.chat_response(await run(req, request), model, decode)
        chunk = R.stream_chunker("chatcmpl", "chat.completion.chunk", model, req.include_usage)

        def render(i: int, p: Progress) -> list[dict[str, Any]]:
            delta = {"content": p.text} if p.text or p.finish_reason is None else {}
            return [chunk([{"index": i, "delta": delta, "token_ids": p.token_ids,
                            "logprobs": R.chat_logprobs(p.logprobs, decode),
                            "finish_reason": p.finish_reason}])]  # fmt: skip

        def finish(outs: list[RequestOutput]) -> list[dict[str, Any]]:
            return [chunk([], usage=R.usage(outs))] if req.include_usage else []

        opening = [chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}]) for i in range(req.n)]  # fmt: skip
        return await stream(req, request, render, finish, opening)

    @app.post("/generate", response_model=None)
    async def generate(request: Request) -> Any:
        req = P.parse_generate(await _json_body(request, max_body_bytes))
        rid = R.new_id("gen")
        if not req.stream:
            outs = await run(req, request)
            answers = [R.generate_response(rid, o.text, o.output_ids, o.finish_reason, o) for o in outs]
            return answers[0] if req.n == 1 else answers
        texts: list[str] = [""] * req.n
        ids: list[list[int]] = [[] for _ in range(req.n)]

        def render(i: int, p: Progress) -> list[dict[str, Any]]:
            texts[i] += p.text
            ids[i] += p.token_ids
            return [{"index": i, **R.generate_response(rid, texts[i], ids[i], p.finish_reason)}]

        return await stream(req, request, render, lambda _: [], [])

    # ------------------------------------------------------------------ info
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model, "object": "model", "created": created, "owned_by": "kvcanary",
                "max_model_len": engine.runner.max_context_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> JSONResponse:
        if not ready.is_set():
            return JSONResponse({"status": "starting"}, status_code=503)
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


def _consume(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


async def _disconnect(request: Request) -> None:
    """Return when the client disconnects (the body has been read: the next message the
    server receives for this request is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _json_body(request: Request, max_body_bytes: int) -> Any:
    raw = await request.body()
    if len(raw) > max_body_bytes:  # a chunked body has no content-length to check up front
        raise HTTPError(413, too_large(len(raw), max_body_bytes)["error"]["message"],
                        "invalid_request_error", "request_too_large")  # fmt: skip
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from None
