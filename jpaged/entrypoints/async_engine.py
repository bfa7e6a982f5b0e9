"""AsyncLLMEngine: an asyncio front end over the engine's step loop.

One background thread owns the LLMEngine (which is not thread-safe) and the OutputProcessor, through
the text request path `LLM` uses too (`jpaged.text.requests.TextRequests`): it takes commands (add,
abort) from a queue between steps, steps while any request is unfinished, ends samples at stop
strings before the next step, and hands each step's outputs to the event loop in one
`call_soon_threadsafe`. The thread sleeps on the queue while the engine is idle. The model's
compute releases the GIL, so the event loop (HTTP) runs while a step computes.

Each request is an async iterator of incremental outputs. When its consumer falls behind, the
outputs waiting for it merge (deltas concatenate; cumulative and final outputs replace), as in
vLLM v1, so a slow client costs one chunk per read, not one per token. Closing or cancelling the
iterator before the end aborts the request: it leaves the engine at the next step, its blocks freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from jpaged.core.outputs import RequestOutput
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.entrypoints.engine_args import load_engine
from jpaged.text.output_processor import prompt_ids
from jpaged.text.requests import TextRequest, TextRequests
from jpaged.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine's step loop failed or was shut down; no request can be served any more."""


class RequestAborted(RuntimeError):
    """Raised to a request's reader when `abort_all` ended it (the server shuts down): it need not
    wait for the engine's next step to learn it."""


def merge_outputs(old: RequestOutput, new: RequestOutput, kind: str) -> RequestOutput:
    """Two consecutive outputs of one request as one (deltas concatenate per sample)."""
    if kind != "delta":
        return new
    merged = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = merged.get(c.index)
        if prev is None:
            merged[c.index] = c
            continue
        logprobs = None if prev.logprobs is None and c.logprobs is None else (prev.logprobs or []) + (c.logprobs or [])
        merged[c.index] = dataclasses.replace(c, token_ids=prev.token_ids + c.token_ids, text=prev.text + c.text,
                                              logprobs=logprobs)
    # Prompt log-probabilities come once (in the first delta after the prompt): keep them.
    prompt = (new.prompt_logprobs, new.prompt_ranks) if new.prompt_logprobs is not None else (
        old.prompt_logprobs, old.prompt_ranks)
    return dataclasses.replace(new, outputs=[merged[i] for i in sorted(merged)], prompt_logprobs=prompt[0],
                               prompt_ranks=prompt[1])


class _Collector:
    """The outputs of one request not yet read by its consumer (lives on the event loop)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.pending: RequestOutput | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self.error is not None:  # ended already (abort_all): the reader learns nothing newer
            return
        self.pending = output if self.pending is None else merge_outputs(self.pending, output, self.kind)
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()  # set by put (pending) or fail (error)
        output, self.pending = self.pending, None
        if output is None:
            raise self.error
        if self.error is None:  # once failed it stays set: the next get raises at once
            self.ready.clear()
        return output


@dataclasses.dataclass
class _Add:
    request: TextRequest
    done: asyncio.Future  # resolved on the event loop: None, or the add_request error


class RequestStream:
    """One request's outputs, an async iterator; `aclose()` before its end aborts the request
    (also when iteration never started), and so does cancelling a task waiting on it."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, collector: _Collector):
        self.request_id = request_id
        self._engine, self._collector = engine, collector
        self.finished = False  # its final output was returned, or it was closed

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            output = await self._collector.get()
        except asyncio.CancelledError:
            await self.aclose()
            raise
        if output.finished:
            self.finished = True
            self._engine._close(self.request_id, finished=True)
        return output

    async def aclose(self) -> None:
        """Stops reading; an unfinished request is aborted (its blocks freed at the next step)."""
        if not self.finished:
            self.finished = True
            self._engine._close(self.request_id, finished=False)


class _LoopClosed(Exception):
    """The event loop the engine reports to is closed: nobody can read an output any more."""


class AsyncLLMEngine:
    """Serves requests concurrently from asyncio code; one thread steps the engine."""

    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer | None, stream_interval: int = 1):
        """`stream_interval`: report streams every that many engine steps (see OutputProcessor)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self._requests = TextRequests(engine, tokenizer, stream_interval)  # used by the step loop only
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._collectors: dict[str, _Collector] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._num_requests = 0
        self.error: BaseException | None = None  # why the step loop died, if it did

    @classmethod
    def from_model(cls, model: str, stream_interval: int = 1, **kwargs: Any) -> AsyncLLMEngine:
        """Builds the engine as `jpaged.LLM` does (model, config=, tokenizer=, engine arguments)."""
        return cls(*load_engine(model, **kwargs), stream_interval=stream_interval)

    @property
    def is_dead(self) -> bool:
        """True when the step loop failed or was shut down."""
        return self.error is not None

    def start(self) -> None:
        """Starts the step loop on the running event loop (done by the first request, too)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine is not running: {self.error}")
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="jpaged-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stops the step loop (unfinished requests end with EngineDeadError) and waits for it (not
        after `fail`: its thread may never come back)."""
        if self._thread is not None and self._thread.is_alive():
            self._commands.put(None)
            self._thread.join(timeout if self.error is None else 0)
        if self.error is None:
            self.error = EngineDeadError("the engine was shut down")

    def fail(self, error: BaseException) -> None:
        """Declares the engine dead from outside its step loop, from any thread: every unfinished
        request (and every one waiting to be queued) ends with `error`, new ones are refused and
        `is_dead` turns true. For failures the step loop cannot report because it may never return
        from its step (a multi-process run whose follower died inside a collective)."""
        if self.error is None:
            self.error = error
        if self._loop is not None:
            with contextlib.suppress(_LoopClosed):  # nobody is waiting
                self._post(self._fail_all, self.error)

    # ------------------------------------------------------------------ requests (event loop)

    def new_request_id(self, prefix: str = "req") -> str:
        """A request id no other request of this engine has."""
        self._num_requests += 1
        return f"{prefix}-{self._num_requests}"

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_salt: str | None = None) -> RequestStream:
        """Queues a request once the engine accepted it; returns its stream of outputs.

        Raises ValueError / TypeError (naming the field) when the engine refuses the request,
        before anything is streamed. `params.output_kind` says what each output holds. A text
        prompt is encoded in a worker thread (a long one takes seconds: the event loop goes on).
        """
        if isinstance(prompt, str):
            ids, text = await asyncio.to_thread(prompt_ids, prompt, self.tokenizer)
        else:
            ids, text = prompt_ids(prompt, self.tokenizer)
        self.start()
        if request_id in self._collectors:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        collector = self._collectors[request_id] = _Collector(params.output_kind)
        done = self._loop.create_future()
        self._commands.put(_Add(TextRequest(request_id, ids, params, text, cache_salt), done))
        try:
            await done
        except BaseException:
            self._collectors.pop(request_id, None)
            if not done.done() or done.cancelled():  # cancelled while waiting: it may still be added
                self._commands.put(("abort", request_id))
            raise
        return RequestStream(self, request_id, collector)

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (an async generator; see `add_request`)."""
        stream = await self.add_request(request_id or self.new_request_id(), prompt, params)
        async with contextlib.aclosing(stream):  # closing this generator closes (aborts) the request
            async for output in stream:
                yield output

    def _close(self, request_id: str, finished: bool) -> None:
        self._collectors.pop(request_id, None)
        if not finished:  # closed or cancelled early: the request leaves the engine
            self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Aborts a request (its stream ends with finish reason "abort" at the next step)."""
        self._commands.put(("abort", request_id))

    @property
    def num_open_requests(self) -> int:
        """Requests added whose streams have not ended yet."""
        return len(self._collectors)

    def abort_all(self, reason: str = "aborted") -> int:
        """Aborts every open request: the engine frees their blocks at its next step, and each reader
        gets what was pending, then RequestAborted(reason) at once. How many were open."""
        for request_id, collector in self._collectors.items():
            self._commands.put(("abort", request_id))
            collector.fail(RequestAborted(reason))
        return len(self._collectors)

    # ------------------------------------------------------------------ the step loop (its thread)

    def _run(self) -> None:
        requests = self._requests
        try:
            while True:
                # Idle: sleep until a command arrives; busy: take what is queued, then step.
                block = not requests.has_unfinished()
                while True:
                    try:
                        command = self._commands.get(block=block)
                    except queue.Empty:
                        break
                    if command is None:
                        return
                    self._apply(command)
                    block = False
                if not requests.has_unfinished():
                    continue
                outputs = requests.step()
                if outputs:
                    self._post(self._deliver, outputs)
        except _LoopClosed:  # its owner closed the event loop without `shutdown`: end quietly
            pass
        except BaseException as exc:  # the engine is broken: every request learns why
            log.exception("the engine's step loop failed")
            self.error = self.error or exc  # (after `fail`, its error: the cause, not the symptom)
        finally:
            if self.error is None:
                self.error = EngineDeadError("the engine was shut down")
            with contextlib.suppress(_LoopClosed):  # nobody is waiting
                self._post(self._fail_all, self.error)

    def _apply(self, command: _Add | tuple[str, str]) -> None:
        """Runs one command on the engine thread."""
        if isinstance(command, _Add):
            error = None
            try:
                self._requests.add(command.request)
            except Exception as exc:  # the request's own problem (ValueError / TypeError naming the field)
                error = exc
            self._post(_resolve, command.done, error)
            return
        _, request_id = command
        # Its final output (finish reason "abort") comes with the next step; finished already: nothing to stop.
        self._requests.abort(request_id)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        """Runs `callback(*args)` on the event loop; raises _LoopClosed when that loop is closed."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError as exc:
            if self._loop.is_closed():
                raise _LoopClosed from exc
            raise

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """On the event loop: each output to its request's collector."""
        for output in outputs:
            collector = self._collectors.get(output.request_id)
            if collector is not None:
                collector.put(output)

    def _fail_all(self, error: BaseException) -> None:
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(f"the engine failed: {error!r}")
        for collector in self._collectors.values():
            collector.fail(dead)
        while True:  # requests still queued for the step loop will never be taken
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                _resolve(command.done, dead)


def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():  # cancelled, or failed by `_fail_all` before the step loop answered
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)

