"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncLLMEngine, run by uvicorn.

    jpaged serve --model assets/stdlib-lm --port 8000 [--config engine.yaml]

Routes: POST /v1/completions and /v1/chat/completions (non-streaming JSON, or `stream: true` as
server-sent events ending in `data: [DONE]`), GET /v1/models, /health, /metrics (Prometheus).
What the door checks, before a request reaches the engine (400 + OpenAI error JSON naming the
field): the body's JSON and every field's type and range (jpaged.entrypoints.serve.protocol), the model
name (404), prompts (text needs a tokenizer; ids must be in the vocabulary), the chat messages
against the chat template, prompt + max_tokens within max_model_len, and what LLMEngine.add_request
refuses (n > max_num_seqs, a prompt larger than the KV pool). A refused request changes nothing;
the others keep being served. A client that disconnects (streaming or not) aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from jpaged.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError
from jpaged.entrypoints.serve.completions import ChatHandler, CompletionHandler
from jpaged.entrypoints.serve.metrics import PrometheusObserver
from jpaged.entrypoints.serve.protocol import ChatCompletionRequest, CompletionRequest, RequestError, pydantic_error
from jpaged.entrypoints.serve.responses import error_body
from jpaged.text.chat_template import ChatTemplateError

log = logging.getLogger(__name__)


def error_response(err: RequestError) -> JSONResponse:
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


def build_app(engine: AsyncLLMEngine, model_name: str, metrics: PrometheusObserver | None = None) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name`; `metrics` must observe the engine already."""
    metrics = metrics or PrometheusObserver(model_name)
    if metrics not in engine.engine.observers:
        engine.engine.observers.append(metrics)
    max_model_len = engine.engine.config.scheduler.max_model_len

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="jpaged", lifespan=lifespan)
    completions = CompletionHandler(engine, model_name)
    chat = ChatHandler(engine, model_name)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(pydantic_error(exc.errors()))

    @app.exception_handler(RequestError)
    async def _refused(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ChatTemplateError)
    async def _bad_messages(_: Request, exc: ChatTemplateError) -> JSONResponse:
        return error_response(RequestError(f"messages: {exc}", "messages"))

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(RequestError(str(exc), None, 503, "service_unavailable"))

    @app.get("/health")
    async def health() -> Response:
        if engine.is_dead:
            return PlainTextResponse(f"engine dead: {engine.error}", status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "jpaged",
                                            "root": model_name, "max_model_len": max_model_len}]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await _serve(raw, body, completions)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await _serve(raw, body, chat)

    async def _serve(raw: Request, body, handler) -> Response:
        if body.model is not None and body.model != model_name:
            raise RequestError(f"model: the model {body.model!r} does not exist (this server has {model_name!r})",
                               "model", 404, "NotFoundError")
        request_id = f"{handler.prefix}-{uuid.uuid4().hex}"
        streams = await handler.start(request_id, body)  # raises RequestError: nothing was queued
        if body.stream:
            return StreamingResponse(handler.stream(request_id, body, streams), media_type="text/event-stream")
        response = await with_cancellation(raw, handler.collect(request_id, body, streams))
        return response if response is not None else Response(status_code=499)

    return app

