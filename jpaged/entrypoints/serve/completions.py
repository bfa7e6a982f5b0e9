"""The two generation routes: prompts built and checked, queued, then answered whole or as a stream.

`start` builds every prompt in a worker thread (tokenizing a megabyte of text takes seconds; the
event loop keeps serving meanwhile), does every check that needs the model (vocabulary,
max_model_len, max_num_seqs), and queues the prompts in the engine, or raises RequestError having
queued nothing. `collect` waits for the final outputs and answers one JSON body; `stream` yields
server-sent events as the engine moves (a chunk may carry several tokens when the client reads
slowly), then the usage chunk if asked for and `[DONE]`. Closing a stream aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi.responses import JSONResponse

from jpaged.core.outputs import CompletionOutput, RequestOutput
from jpaged.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError, RequestAborted
from jpaged.entrypoints.serve.chat_prompt import chat_prompt
from jpaged.entrypoints.serve.errors import RequestError, error_body
from jpaged.entrypoints.serve.merge import merge_streams
from jpaged.entrypoints.serve.protocol import ChatCompletionRequest, CompletionRequest
from jpaged.entrypoints.serve.responses import (
    ResponseHeader,
    TokenStrings,
    as_token_id,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
    sse,
    usage,
)
from jpaged.entrypoints.serve.structured import compiled
from jpaged.text.tokenizer import check_encodable


@dataclasses.dataclass
class Prompt:
    """One prompt of a request, ready for the engine."""

    ids: list[int]
    field: str  # the request field it came from ("prompt[2]", "messages")
    text: str | None  # its text (a chat prompt's rendering), None for token ids
    truncated: bool = False  # truncate_prompt_tokens cut `ids`: `text` is more than the engine saw


@dataclasses.dataclass
class _Choice:
    """What a stream or a response has told the client about one choice so far."""

    text_offset: int = 0  # legacy logprobs' text_offset of the next token
    num_tokens: int = 0  # output tokens so far (continuous usage stats)
    finished: bool = False  # its finish reason went out
    prompt_sent: bool = False  # return_token_ids: the prompt's ids went out with the first chunk
    echoed: bool = False  # completions' echo: the prompt went out (before the choice's first tokens)


class _Handler:
    """What both routes share: the door checks, queueing, collecting and streaming."""

    prefix = ""
    object_name = ""
    chunk_name = ""

    def __init__(self, engine: AsyncLLMEngine, model_name: str, stream_interval: int = 1):
        self.engine = engine
        self.model_name = model_name
        self.stream_interval = stream_interval
        self.strings = TokenStrings(engine.tokenizer)
        config = engine.engine.config.scheduler
        self.max_model_len, self.max_num_seqs = config.max_model_len, config.max_num_seqs
        self.vocab_size = engine.engine.vocab_size

    def prompts(self, body) -> list[Prompt]:
        """Every prompt of the request, encoded and checked (runs in a worker thread)."""
        raise NotImplementedError

    def request_id(self, body) -> str:
        """The response id: the request's own `request_id` (vLLM's field) or a fresh one."""
        return f"{self.prefix}-{body.request_id or uuid.uuid4().hex}"

    async def start(self, request_id: str, body) -> tuple[list[Prompt], list[AsyncIterator[RequestOutput]]]:
        """Builds, checks and queues every prompt of `body` (engine ids `<request_id>-<i>`)."""
        if body.n > self.max_num_seqs:
            raise RequestError(f"n: {body.n} exceeds this server's max_num_seqs ({self.max_num_seqs})", "n")
        if body.use_beam_search and body.stream:
            raise RequestError("use_beam_search: not supported with stream: true (beams are ranked at the end)",
                               "use_beam_search")
        prompts = await asyncio.to_thread(self._checked_prompts, body)  # off the event loop
        params = [body.sampling_params(self._max_tokens(body, p), self._logprobs(body), self._prompt_logprobs(body),
                                       self.stream_interval) for p in prompts]
        structured = body.structured()
        if structured is not None:  # off the event loop and the engine's thread: a big schema takes a while
            params = await asyncio.to_thread(compiled, params, self.engine.tokenizer, structured[1])
        # All prompts go to the engine at once (each add waits for the engine thread's verdict).
        results = await asyncio.gather(*(self.engine.add_request(f"{request_id}-{i}", p.ids, sp,
                                                                 cache_salt=body.cache_salt)
                                         for i, (p, sp) in enumerate(zip(prompts, params))), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for stream in results:
                if not isinstance(stream, BaseException):
                    await stream.aclose()  # aborts it
            if isinstance(errors[0], (ValueError, TypeError)) and not isinstance(errors[0], RequestError):
                raise _engine_refusal(str(errors[0]), type(body).model_fields) from None
            raise errors[0]
        return prompts, list(results)

    def _checked_prompts(self, body) -> list[Prompt]:
        prompts = self.prompts(body)
        for p in prompts:
            param = p.field.split("[")[0]
            if not p.ids:
                raise RequestError(f"{p.field}: is empty", param)
            if self.vocab_size is not None and not all(0 <= t < self.vocab_size for t in p.ids):
                raise RequestError(f"{p.field}: token ids must be in [0, {self.vocab_size})", param)
            kept = self._truncated(body, p.ids)
            p.ids, p.truncated = kept, len(kept) < len(p.ids)
        return prompts

    def _truncated(self, body, ids: list[int]) -> list[int]:
        """`ids` cut to `truncate_prompt_tokens` (vLLM's: -1 = max_model_len; left keeps the end)."""
        keep = body.truncate_prompt_tokens
        if keep is None:
            return ids
        if keep == 0 or keep > self.max_model_len:
            raise RequestError(f"truncate_prompt_tokens: must be -1 or in [1, {self.max_model_len}] (max_model_len), "
                               f"got {keep}", "truncate_prompt_tokens")
        keep = self.max_model_len if keep == -1 else keep
        if len(ids) <= keep:
            return ids
        return ids[:keep] if body.truncation_side == "right" else ids[-keep:]

    def _max_tokens(self, body, prompt: Prompt) -> int:
        room = self.max_model_len - len(prompt.ids)
        param = prompt.field.split("[")[0]
        if room < 1:
            raise RequestError(f"{param}: {len(prompt.ids)} prompt tokens leave no room to generate within this "
                               f"model's maximum context length of {self.max_model_len} tokens", param)
        asked = body.requested_max_tokens if isinstance(body, ChatCompletionRequest) else body.max_tokens
        if asked is None:
            return room
        if asked == 0:  # echo alone (the protocol allows 0 only then): the engine computes one token, as vLLM's
            return 1
        if asked > room:
            name = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise RequestError(f"{name}: this model's maximum context length is {self.max_model_len} tokens; "
                               f"you requested {len(prompt.ids) + asked} ({len(prompt.ids)} in the prompt, {asked} "
                               "to generate)", name)
        return asked

    def _logprobs(self, body) -> int | None:
        raise NotImplementedError

    def _prompt_logprobs(self, body) -> int | None:
        return body.prompt_logprobs

    def token_strings(self, body) -> Callable[[int], str]:
        """How logprobs spell a token: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
        return as_token_id if body.return_tokens_as_token_ids else self.strings

    def choice(self, index: int, c: CompletionOutput, out: RequestOutput, body, state: _Choice,
               prompt: Prompt) -> dict:
        """One choice of a response or a stream chunk: sample `c` of the engine's output `out` for
        `prompt` (`state` is the choice's progress so far)."""
        raise NotImplementedError

    def aborted_choice(self, index: int) -> dict:
        """The last chunk of a choice ended by the server's shutdown."""
        raise NotImplementedError

    def extra_fields(self, body, prompts: list[Prompt], first: bool) -> dict:
        """Fields beside the choices (a chat response's prompt ids and text); `first`: the first chunk."""
        return {}

    def result_fields(self, body, outs: list[RequestOutput]) -> dict:
        """Fields of a whole (not streamed) response that need the engine's outputs `outs`."""
        return {}

    async def collect(self, request_id: str, body, prompts: list[Prompt],
                      streams: list[AsyncIterator[RequestOutput]]) -> JSONResponse:
        """The whole answer as one JSON body."""
        finals: dict[int, RequestOutput] = {}
        async with contextlib.aclosing(merge_streams(streams)) as merged:
            async for i, out in merged:
                finals[i] = out
        outs = [finals[i] for i in range(len(streams))]
        errors = [o.error for o in outs if o.error]
        if errors:
            raise RequestError(f"the engine ended the request: {errors[0]}", None)
        choices = [self.choice(i * body.n + c.index, c, out, body, _Choice(), prompts[i])
                   for i, out in enumerate(outs) for c in out.outputs]
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        completion_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        header = ResponseHeader(request_id, self.object_name, self.model_name)
        return JSONResponse(header(choices=choices, usage=usage(prompt_tokens, completion_tokens),
                                   **self.extra_fields(body, prompts, True), **self.result_fields(body, outs)))

    def first_chunks(self, header: ResponseHeader, body, prompts: list[Prompt]) -> list[str]:
        """Chunks a stream opens with, before the engine's first output."""
        return []

    async def stream(self, request_id: str, body, prompts: list[Prompt],
                     streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[str]:
        """Server-sent events: chunks as the engine moves, usage (if asked), then [DONE]."""
        header = ResponseHeader(request_id, self.chunk_name, self.model_name)
        options = body.stream_options
        include_usage = options is not None and bool(options.include_usage)
        continuous = include_usage and bool(options.continuous_usage_stats)
        prompt_tokens = completion_tokens = 0
        states: dict[int, _Choice] = {}
        try:
            async with contextlib.aclosing(merge_streams(streams)) as merged:
                for chunk in self.first_chunks(header, body, prompts):
                    yield chunk
                async for i, out in merged:
                    chosen = [(i * body.n + c.index, c) for c in out.outputs]
                    choices = [self.choice(k, c, out, body, states.setdefault(k, _Choice()), prompts[i])
                               for k, c in chosen]
                    completion_tokens += sum(len(c.token_ids) for c in out.outputs)
                    if choices:
                        extra = {}
                        if continuous:  # vLLM's: this prompt and these choices' tokens so far
                            extra["usage"] = usage(len(prompts[i].ids), sum(states[k].num_tokens for k, _ in chosen))
                        yield header.chunk(choices, extra)
                    if out.error:
                        yield sse(error_body(f"the engine ended the request: {out.error}", None))
                    if out.finished:
                        prompt_tokens += len(out.prompt_token_ids)
            if include_usage:
                yield sse(header(choices=[], usage=usage(prompt_tokens, completion_tokens)))
        except RequestAborted:  # the server shuts down: every open choice ends with finish reason "abort"
            ended = [self.aborted_choice(k) for k in range(len(prompts) * body.n)
                     if not states.setdefault(k, _Choice()).finished]
            if ended:
                yield header.chunk(ended)
        except EngineDeadError as exc:
            yield sse(error_body(str(exc), None, "service_unavailable", 503))
        yield sse("[DONE]")


def _engine_refusal(text: str, fields: dict) -> RequestError:
    """The engine door's refusal as a 400 naming the request field: it names its own arguments
    ("request_id: ...", "sampling_params.logit_bias keys: ...", "... sampling_params.best_of=9 exceeds ...")."""
    if text.startswith("request_id:"):
        return RequestError(text, "request_id")
    named = re.search(r"sampling_params\.(\w+)", text)
    if named is None or named.group(1) not in fields:
        return RequestError(text, None)
    return RequestError(f"{named.group(1)}: {text}", named.group(1))


class CompletionHandler(_Handler):
    """POST /v1/completions."""

    prefix, object_name, chunk_name = "cmpl", "text_completion", "text_completion"

    def prompts(self, body: CompletionRequest) -> list[Prompt]:
        given = body.prompts()
        texts = [(p, field) for p, field in given if isinstance(p, str)]
        if texts and self.engine.tokenizer is None:
            raise RequestError(f"{texts[0][1]}: text prompts need a tokenizer (this model has none: send token ids)",
                               "prompt")
        for text, field in texts:
            if not text:
                raise RequestError(f"{field}: is empty", "prompt")
            try:
                check_encodable(text, field)
            except ValueError as exc:
                raise RequestError(str(exc), field) from None
        # encode_batch: the Rust side encodes the texts in parallel, without the GIL.
        encoded = iter(self.engine.tokenizer.encode_batch([t for t, _ in texts], body.add_special_tokens)
                       if texts else [])
        return [Prompt(next(encoded), field, p) if isinstance(p, str) else Prompt(list(p), field, None)
                for p, field in given]

    def _logprobs(self, body: CompletionRequest) -> int | None:
        return body.logprobs

    def _prompt_logprobs(self, body: CompletionRequest) -> int | None:
        return body.num_prompt_logprobs

    def aborted_choice(self, index: int) -> dict:
        return {"index": index, "text": "", "logprobs": None, "finish_reason": "abort", "stop_reason": None}

    def choice(self, index: int, c: CompletionOutput, out: RequestOutput, body: CompletionRequest, state: _Choice,
               prompt: Prompt) -> dict:
        token_ids, entries, text = c.token_ids, c.logprobs, c.text
        if body.echo and not state.echoed:  # the choice's first chunk (or whole answer): the prompt leads
            state.echoed = True
            token_ids, entries, text = self._echoed(c, out, body, prompt)
        elif body.echo and body.max_tokens == 0:  # a stream's later chunks: nothing past the prompt
            token_ids, entries, text = [], [], ""
        logprobs = None
        if body.logprobs is not None:
            logprobs, state.text_offset = completion_logprobs(self.token_strings(body), token_ids, entries,
                                                              body.logprobs, state.text_offset)
        state.num_tokens += len(c.token_ids)
        state.finished = c.finish_reason is not None
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if out.prompt_logprobs is not None and not body.stream:  # vLLM's: per choice, never streamed
            choice["prompt_logprobs"] = prompt_logprobs_json(self.strings, out.prompt_logprobs, out.prompt_ranks,
                                                             body.num_prompt_logprobs)
        if body.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
            if not state.prompt_sent:  # streams send the prompt's ids with a choice's first chunk only
                choice["prompt_token_ids"] = prompt.ids
                state.prompt_sent = True
        return choice

    def _echoed(self, c: CompletionOutput, out: RequestOutput, body: CompletionRequest, prompt: Prompt
                ) -> tuple[list[int], list | None, str]:
        """(token ids, their logprob entries, text) of an echo: the prompt's (its text as given, or
        its token ids decoded when it came as ids or was truncated), then the sample's unless
        max_tokens is 0 (vLLM's shapes). The entries are None unless logprobs were asked for."""
        ids = out.prompt_token_ids
        if prompt.text is not None and not prompt.truncated:
            prompt_text = prompt.text
        else:
            tokenizer = self.engine.tokenizer
            prompt_text = tokenizer.decode(ids, skip_special_tokens=False) if tokenizer is not None else ""
        prompt_entries = out.prompt_logprobs if body.logprobs is not None else None
        if body.max_tokens == 0:
            return ids, prompt_entries, prompt_text
        entries = None if prompt_entries is None else prompt_entries + (c.logprobs or [])
        return ids + c.token_ids, entries, prompt_text + c.text


class ChatHandler(_Handler):
    """POST /v1/chat/completions."""

    prefix, object_name, chunk_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def prompts(self, body: ChatCompletionRequest) -> list[Prompt]:
        ids, text = chat_prompt(self.engine.tokenizer, body)
        return [Prompt(ids, "messages", text)]

    def _logprobs(self, body: ChatCompletionRequest) -> int | None:
        return body.num_logprobs

    def aborted_choice(self, index: int) -> dict:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": "abort", "stop_reason": None}

    def choice(self, index: int, c: CompletionOutput, out: RequestOutput, body: ChatCompletionRequest,
               state: _Choice, prompt: Prompt) -> dict:
        logprobs = chat_logprobs(self.token_strings(body), c, body.top_logprobs or 0) if body.logprobs else None
        state.num_tokens += len(c.token_ids)
        state.finished = c.finish_reason is not None
        message = {"role": "assistant", "content": c.text}
        key = "delta" if body.stream else "message"
        if body.stream:
            message = {"content": c.text} if c.text or c.finish_reason is None else {}
        choice = {"index": index, key: message, "logprobs": logprobs, "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if body.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    def extra_fields(self, body: ChatCompletionRequest, prompts: list[Prompt], first: bool) -> dict:
        extra = {}
        if first and body.return_token_ids:
            extra["prompt_token_ids"] = prompts[0].ids
        if first and body.return_prompt_text:
            extra["prompt_text"] = prompts[0].text
        return extra

    def result_fields(self, body: ChatCompletionRequest, outs: list[RequestOutput]) -> dict:
        """vLLM's `prompt_logprobs` of the chat prompt, when asked for."""
        out = outs[0]
        if out.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs_json(self.strings, out.prompt_logprobs, out.prompt_ranks,
                                                        body.prompt_logprobs)}

    def first_chunks(self, header: ResponseHeader, body: ChatCompletionRequest, prompts: list[Prompt]) -> list[str]:
        """Each choice opens with the assistant's role, as OpenAI's streams do (the first also
        carries the prompt's ids and text when asked for)."""
        return [header.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None}], self.extra_fields(body, prompts, i == 0))
                for i in range(len(prompts) * body.n)]
