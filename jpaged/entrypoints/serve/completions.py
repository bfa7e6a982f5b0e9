"""The two generation routes: prompts checked and queued, then answered whole or as a stream.

`start` does every check that needs the model (tokenizer, vocabulary, max_model_len, max_num_seqs)
and queues the request's prompts in the engine, or raises RequestError having queued nothing.
`collect` waits for the final outputs and answers one JSON body; `stream` yields server-sent
events as the engine moves (a chunk may carry several tokens when the client reads slowly),
then the usage chunk if asked for and `[DONE]`. Closing a stream aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse

from jpaged.core.outputs import CompletionOutput, RequestOutput
from jpaged.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError
from jpaged.entrypoints.serve.protocol import ChatCompletionRequest, CompletionRequest, RequestError
from jpaged.entrypoints.serve.responses import (
    ResponseHeader,
    TokenStrings,
    chat_logprobs,
    completion_logprobs,
    error_body,
    sse,
    usage,
)
from jpaged.text.output_processor import prompt_ids


class _Handler:
    """What both routes share: the door checks, queueing, collecting and streaming."""

    prefix = ""
    object_name = ""
    chunk_name = ""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.strings = TokenStrings(engine.tokenizer)
        config = engine.engine.config.scheduler
        self.max_model_len, self.max_num_seqs = config.max_model_len, config.max_num_seqs
        self.vocab_size = engine.engine.vocab_size

    def prompts(self, body) -> list[tuple[list[int], str]]:
        """(token ids, the field they came from) of each prompt of the request."""
        raise NotImplementedError

    async def start(self, request_id: str, body) -> list[AsyncIterator[RequestOutput]]:
        """Checks and queues every prompt of `body` (engine ids `<request_id>-<i>`); their streams."""
        if body.n > self.max_num_seqs:
            raise RequestError(f"n: {body.n} exceeds this server's max_num_seqs ({self.max_num_seqs})", "n")
        prompts = self.prompts(body)  # every check that can fail before anything is queued
        params = [body.sampling_params(self._max_tokens(body, ids, field), self._logprobs(body))
                  for ids, field in prompts]
        # All prompts go to the engine at once (each add waits for the engine thread's verdict).
        results = await asyncio.gather(*(self.engine.add_request(f"{request_id}-{i}", ids, p)
                                         for i, ((ids, _), p) in enumerate(zip(prompts, params))),
                                       return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for stream in results:
                if not isinstance(stream, BaseException):
                    await stream.aclose()  # aborts it
            if isinstance(errors[0], (ValueError, TypeError)):
                raise RequestError(str(errors[0]), None) from None
            raise errors[0]
        return list(results)

    def _encode(self, prompt: str | list[int], field: str) -> list[int]:
        try:
            ids, _ = prompt_ids(prompt, self.engine.tokenizer, field)
        except ValueError as exc:
            raise RequestError(str(exc), field.split("[")[0]) from None
        if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in ids):
            raise RequestError(f"{field}: token ids must be in [0, {self.vocab_size})", field.split("[")[0])
        return ids

    def _max_tokens(self, body, ids: list[int], field: str) -> int:
        room = self.max_model_len - len(ids)
        param = field.split("[")[0]
        if room < 1:
            raise RequestError(f"{param}: {len(ids)} prompt tokens leave no room to generate within this model's "
                               f"maximum context length of {self.max_model_len} tokens", param)
        asked = body.requested_max_tokens if isinstance(body, ChatCompletionRequest) else body.max_tokens
        if asked is None:
            return room
        if asked > room:
            raise RequestError(f"max_tokens: this model's maximum context length is {self.max_model_len} tokens; "
                               f"you requested {len(ids) + asked} ({len(ids)} in the prompt, {asked} to generate)",
                               "max_tokens")
        return asked

    def _logprobs(self, body) -> int | None:
        raise NotImplementedError

    def choice(self, index: int, c: CompletionOutput, body, state: dict) -> dict:
        raise NotImplementedError

    async def collect(self, request_id: str, body, streams: list[AsyncIterator[RequestOutput]]) -> JSONResponse:
        """The whole answer as one JSON body."""
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for i, out in merged:
                finals[i] = out
        outs = [finals[i] for i in range(len(streams))]
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RequestError(f"the engine ended the request: {errors[0]}", None)
        choices, state = [], {}
        for i, out in enumerate(outs):
            choices += [self.choice(i * body.n + c.index, c, body, state) for c in out.outputs]
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        completion_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        header = ResponseHeader(request_id, self.object_name, self.model_name)
        return JSONResponse(header(choices=choices, usage=usage(prompt_tokens, completion_tokens)))

    def first_chunks(self, header: ResponseHeader, body, num_prompts: int) -> list[str]:
        return []

    async def stream(self, request_id: str, body, streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        """Server-sent events: chunks as the engine moves, usage (if asked), then [DONE]."""
        header = ResponseHeader(request_id, self.chunk_name, self.model_name)
        prompt_tokens = completion_tokens = 0
        state: dict = {}
        try:
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                for chunk in self.first_chunks(header, body, len(streams)):
                    yield chunk
                async for i, out in merged:
                    choices = [self.choice(i * body.n + c.index, c, body, state) for c in out.outputs]
                    completion_tokens += sum(len(c.token_ids) for c in out.outputs)
                    if choices:
                        yield header.chunk(choices)
                    if out.error:
                        yield sse(error_body(f"the engine ended the request: {out.error}", None))
                    if out.finished:
                        prompt_tokens += len(out.prompt_token_ids)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield sse(header(choices=[], usage=usage(prompt_tokens, completion_tokens)))
        except EngineDeadError as exc:
            yield sse(error_body(str(exc), None, "service_unavailable", 503))
        yield sse("[DONE]")


class CompletionHandler(_Handler):
    """POST /v1/completions."""

    prefix, object_name, chunk_name = "cmpl", "text_completion", "text_completion"

    def prompts(self, body: CompletionRequest) -> list[tuple[list[int], str]]:
        prompts = body.prompts()
        fields = ["prompt"] if len(prompts) == 1 else [f"prompt[{i}]" for i in range(len(prompts))]
        return [(self._encode(p, f), f) for p, f in zip(prompts, fields)]

    def _logprobs(self, body: CompletionRequest) -> int | None:
        return body.logprobs

    def choice(self, index: int, c: CompletionOutput, body: CompletionRequest, state: dict) -> dict:
        logprobs = None
        if body.logprobs is not None:
            logprobs, state[index] = completion_logprobs(self.strings, c, state.get(index, 0))
        return {"index": index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}


class ChatHandler(_Handler):
    """POST /v1/chat/completions."""

    prefix, object_name, chunk_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def prompts(self, body: ChatCompletionRequest) -> list[tuple[list[int], str]]:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise RequestError("messages: this model has no tokenizer (and no chat template)", "messages")
        ids = tokenizer.apply_chat_template(body.message_dicts(), add_generation_prompt=body.add_generation_prompt,
                                            tokenize=True)
        return [(ids, "messages")]

    def _logprobs(self, body: ChatCompletionRequest) -> int | None:
        return body.num_logprobs

    def choice(self, index: int, c: CompletionOutput, body: ChatCompletionRequest, state: dict) -> dict:
        logprobs = chat_logprobs(self.strings, c, body.top_logprobs or 0) if body.logprobs else None
        message = {"role": "assistant", "content": c.text}
        key = "delta" if body.stream else "message"
        if body.stream:
            message = {"content": c.text} if c.text or c.finish_reason is None else {}
        return {"index": index, key: message, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def first_chunks(self, header: ResponseHeader, body: ChatCompletionRequest, num_prompts: int) -> list[str]:
        """Each choice opens with the assistant's role, as OpenAI's streams do."""
        return [header.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}]) for i in range(num_prompts * body.n)]


def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several request streams as they come; closing it closes them all."""
    if len(streams) == 1:
        return _tagged(streams[0])
    return _merged(streams)


async def _tagged(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    try:
        async for output in stream:
            yield 0, output
    finally:
        await stream.aclose()


async def _merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[i]))] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()
        for stream in streams:
            await stream.aclose()
