"""The load one request and a burst of them may put on the server.

- A request body's bytes (`--max-request-body-bytes`, BodySizeLimit): a declared Content-Length
  past the bound gets 413 before a byte of the body is read; a body without one (chunked) gets 413
  as soon as what was read passes it. The default, 16 MiB, holds a 128 K-token prompt several
  times over in any form (as token ids about 1 MB of JSON, as text about 0.5 MB, up to 6 bytes a
  character when \\u-escaped) and a batch of such prompts, while a client cannot make the server
  buffer and parse (at several times the bytes, as Python objects) more than that per request.
- The requests waiting for the engine (`--max-queued-requests`, RequestQueue): past the bound a
  generation request gets 503 with Retry-After (the server is overloaded for the moment: RFC
  9110's 503, where 429 would blame the client's own rate) and is counted in
  `jpaged:requests_shed`. Nothing already admitted is touched: the engine keeps serving it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from jpaged.entrypoints.async_engine import AsyncLLMEngine
from jpaged.entrypoints.serve.errors import RequestError, error_body

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# What a shed request is told to wait before retrying: the queue moves by the engine's steps,
# tens of milliseconds each, so a second later it has room again unless the burst goes on.
RETRY_AFTER_S = 1


class _BodyTooLarge(Exception):
    """Raised from `receive` to the route reading a body past the bound (caught by BodySizeLimit)."""


class BodySizeLimit:
    """ASGI middleware: 413 for a request whose body has more than `max_bytes` bytes."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> JSONResponse:
        return JSONResponse(error_body(f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                                       f"(--max-request-body-bytes)", None, "invalid_request_error", 413),
                            status_code=413)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None:
            if not declared.isdigit():  # uvicorn refuses these itself; another server might not
                response = JSONResponse(error_body(f"Content-Length: not a number of bytes, got {declared!r}", None),
                                        status_code=400)
                await response(scope, receive, send)
                return
            if int(declared) > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
        received = 0
        started = False

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        except _BodyTooLarge:
            if started:  # a route that answered before reading all of its body: nothing more to say
                return
            await self._too_large()(scope, receive, send)


class QueueFull(RequestError):
    """A generation request refused because the queue is at its bound (503; the app adds Retry-After)."""

    def __init__(self, max_queued: int):
        super().__init__(f"the server is overloaded: {max_queued} requests are waiting for the engine "
                         f"(--max-queued-requests); retry after {RETRY_AFTER_S} s", None, 503, "service_unavailable")
        self.retry_after_s = RETRY_AFTER_S


class RequestQueue:
    """Admission of generation requests against `max_queued` waiting ones (None: no bound)."""

    def __init__(self, engine: AsyncLLMEngine, max_queued: int | None, on_shed: Callable[[], None]):
        """`on_shed()` is called for each refused request (the metrics' counter)."""
        self.engine, self.max_queued, self._on_shed = engine, max_queued, on_shed
        self._arriving = 0  # admitted requests whose prompts are not in the engine yet

    @property
    def num_queued(self) -> int:
        """Requests admitted and not yet scheduled: those at the door (prompts being built, or queued
        for the engine's thread) and the scheduler's waiting queue. The queue is the engine
        thread's; `len` of its deque is atomic, and a value one step old moves the bound by what one
        step admits at most. A request leaving the door may be counted twice for a moment: that
        errs towards refusing."""
        return self._arriving + len(self.engine.engine.scheduler.waiting)

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Holds a place at the door while the request's prompts go to the engine; raises QueueFull
        (nothing queued) when `max_queued` requests are waiting."""
        if self.max_queued is not None and self.num_queued >= self.max_queued:
            self._on_shed()
            raise QueueFull(self.max_queued)
        self._arriving += 1
        try:
            yield
        finally:
            self._arriving -= 1
