"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine, run by uvicorn.

    jpaged serve --model assets/stdlib-lm --port 8000 [--config engine.yaml]

Routes: POST /v1/completions and /v1/chat/completions (non-streaming JSON, or `stream: true` as
server-sent events ending in `data: [DONE]`), GET /v1/models; vLLM's POST /tokenize, /detokenize,
GET /tokenizer_info, /version; GET /health (200 when ready, 503 while warming up, draining or
dead) and /metrics (Prometheus, vLLM v1's names).
What the door checks, before a request reaches the engine (OpenAI's error object naming the
field): the content type and the JSON (errors.py), every field's type, range and neutrality
(protocol.py, fields.py), the model name (404), the prompts (chat_prompt.py, completions.py:
tokenizer, encodable text, vocabulary, max_model_len), and what LLMEngine.add_request refuses
(n > max_num_seqs, a prompt larger than the KV pool). A refused request changes nothing; the
others keep being served. A client that disconnects (streaming or not) aborts its requests.
Before any of that (`Exposure`): the API key (security.py: 401 outside /health, /metrics, /version
and the docs), the body's size (limits.py: 413) and, for generation, the queue's bound (limits.py:
503 with Retry-After); CORS when asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from jpaged.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError, RequestAborted
from jpaged.entrypoints.serve import tokenize
from jpaged.entrypoints.serve.completions import ChatHandler, CompletionHandler
from jpaged.entrypoints.serve.errors import RequestError, error_body, parse_body, validation_error
from jpaged.entrypoints.serve.limits import BodySizeLimit, QueueFull, RequestQueue
from jpaged.entrypoints.serve.metrics import PrometheusObserver
from jpaged.entrypoints.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from jpaged.entrypoints.serve.security import APIKeyAuth, Exposure
from jpaged.entrypoints.serve.state import ServerState
from jpaged.text.chat_template import ChatTemplateError

log = logging.getLogger(__name__)


def error_response(err: RequestError) -> JSONResponse:
    """`err` as OpenAI's error object with its status."""
    return JSONResponse(error_body(err.message, err.param, err.kind, err.status), status_code=err.status)


async def _until_disconnected(request: Request) -> None:
    """Returns when the client goes away (the body was read already, so only http.disconnect comes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def with_cancellation(request: Request, work: Awaitable[Response]) -> Response | None:
    """Runs a non-streaming handler; cancels it (aborting its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    done, _ = await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watch.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's error object, whatever raised it."""

    @app.exception_handler(RequestError)
    async def _refused(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)  # query or path parameters (bodies: parse_body)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(QueueFull)
    async def _shed(_: Request, exc: QueueFull) -> JSONResponse:
        response = error_response(exc)
        response.headers["Retry-After"] = str(exc.retry_after_s)
        return response

    @app.exception_handler(ChatTemplateError)
    async def _bad_messages(_: Request, exc: ChatTemplateError) -> JSONResponse:
        return error_response(RequestError(f"messages: {exc}", "messages"))

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(RequestAborted)  # the server shut down before the answer was complete
    async def _dead(_: Request, exc: RuntimeError) -> JSONResponse:
        return error_response(RequestError(str(exc), None, 503, "service_unavailable"))

    @app.exception_handler(ClientDisconnect)  # the client left before its whole body came: nobody to answer
    async def _gone(request: Request, _: ClientDisconnect) -> Response:
        log.info("%s %s: the client disconnected before sending its whole body", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(HTTPException)  # no such route (404), wrong method (405), ...
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(RequestError(f"{request.method} {request.url.path}: {exc.detail}", None,
                                           exc.status_code, kind))

    @app.exception_handler(Exception)  # a bug: the request fails alone, the server goes on
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(RequestError(f"internal error: {exc!r}", None, 500, "internal_server_error"))


def _install_middleware(app: FastAPI, exposure: Exposure) -> None:
    """Outermost first: CORS (answers preflights, and puts its headers on a 401 too), the API key
    (401 before the body is read), the body's bound (413)."""
    app.add_middleware(BodySizeLimit, max_bytes=exposure.max_request_body_bytes)
    if exposure.api_keys:
        app.add_middleware(APIKeyAuth, keys=exposure.api_keys)
    if exposure.cors is not None:
        app.add_middleware(CORSMiddleware, **exposure.cors.middleware_options())


def build_app(engine: AsyncLLMEngine, model_name: str, state: ServerState | None = None,
              metrics: PrometheusObserver | None = None, stream_interval: int = 1,
              exposure: Exposure | None = None) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name`; `state` owns readiness and draining
    (default: warm up at start, drain for 5 s); `exposure`: keys, CORS and limits (default: no
    key, no CORS, the default body bound, no queue bound)."""
    state = state or ServerState(engine)
    metrics = metrics or PrometheusObserver(model_name)
    exposure = exposure or Exposure()
    queue = RequestQueue(engine, exposure.max_queued_requests, on_shed=metrics.shed.inc)
    max_model_len = engine.engine.config.scheduler.max_model_len

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        state.bind(asyncio.get_running_loop())
        warm = asyncio.create_task(state.start(lambda: metrics.attach(engine.engine)))
        try:
            yield
        finally:
            warm.cancel()
            state.stop()

    app = FastAPI(title="jpaged", lifespan=lifespan)
    _install_error_handlers(app)
    _install_middleware(app, exposure)
    completions = CompletionHandler(engine, model_name, stream_interval)
    chat = ChatHandler(engine, model_name, stream_interval)

    @app.get("/health")
    async def health() -> Response:
        if state.is_healthy:
            return Response(status_code=200)
        return PlainTextResponse(state.describe(), status_code=503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": importlib.metadata.version("jpaged")}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "jpaged",
                                            "root": model_name, "max_model_len": max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def parsed(raw: Request, model):
        body = parse_body(await raw.body(), raw.headers.get("content-type"), model)
        if body.model is not None and body.model != model_name:
            raise RequestError(f"model: the model {body.model!r} does not exist (this server has {model_name!r})",
                               "model", 404, "NotFoundError")
        return body

    async def off_loop(work: Callable, *args) -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(work, *args))

    @app.post("/tokenize")
    async def tokenize_route(raw: Request) -> Response:
        body = await parsed(raw, TokenizeRequest)
        return await off_loop(tokenize.tokenize, engine.tokenizer, body, max_model_len)

    @app.post("/detokenize")
    async def detokenize_route(raw: Request) -> Response:
        return await off_loop(tokenize.detokenize, engine.tokenizer, await parsed(raw, DetokenizeRequest))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        return JSONResponse(tokenize.tokenizer_info(engine.tokenizer))

    @app.post("/v1/completions")
    async def create_completion(raw: Request) -> Response:
        return await _serve(raw, await parsed(raw, CompletionRequest), completions)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw: Request) -> Response:
        return await _serve(raw, await parsed(raw, ChatCompletionRequest), chat)

    async def _serve(raw: Request, body, handler) -> Response:
        state.check_accepting()
        request_id = handler.request_id(body)
        with queue.admit():  # raises QueueFull past --max-queued-requests
            prompts, streams = await handler.start(request_id, body)  # raises RequestError: nothing was queued
        if body.stream:
            return StreamingResponse(handler.stream(request_id, body, prompts, streams),
                                     media_type="text/event-stream")
        response = await with_cancellation(raw, handler.collect(request_id, body, prompts, streams))
        return response if response is not None else Response(status_code=499)

    return app
