"""The text request path of one engine, written once for both front doors (`LLM`, `AsyncLLMEngine`).

A text request lives in two places: the OutputProcessor (its text, stop strings, the output kind
its user asked for) and the token-level LLMEngine (its sequences and blocks). `TextRequests` keeps
the two together: a request is added to both or to neither, an abort reaches the engine (its final
output, finish reason "abort", comes back through the processor), and a step is the engine's step
read by the processor. Not thread-safe, like the engine: one owner thread (the caller's for `LLM`,
the step loop's for `AsyncLLMEngine`). Pure Python, no jax.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jpaged.core.outputs import RequestOutput
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.text.output_processor import OutputProcessor, engine_params
from jpaged.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class TextRequest:
    """One request as a front door hands it over (its prompt encoded already: `prompt_ids`)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # as the user gave them (output_kind: what the user wants)
    prompt: str | None = None  # the prompt's text, when it came as text
    cache_salt: str | None = None  # prefix-cache namespace (requests with different salts never share blocks)


class TextRequests:
    """An engine and its OutputProcessor, driven together: add, abort, step."""

    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer | None, stream_interval: int = 1):
        """`stream_interval`: report streams every that many engine steps (see OutputProcessor)."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.processor = OutputProcessor(engine, tokenizer, stream_interval)

    def add(self, request: TextRequest) -> None:
        """Queues one request in the processor and the engine, or in neither: raises ValueError /
        TypeError naming the field when either refuses it (the processor's refusals come first)."""
        self._add(request, None)

    def add_all(self, requests: Sequence[TextRequest], prompt_field: str = "prompts",
                params_field: str = "sampling_params") -> None:
        """Queues every request or none. Each is checked against the engine's limits before any is
        queued (errors name `{prompt_field}[i]` / `{params_field}[i]`); when queueing one still
        fails, those queued before it are withdrawn (the engine reports them aborted at its next
        step and nothing reads it) and the error is raised."""
        for_engine = []  # each request's engine SamplingParams, computed once
        for i, request in enumerate(requests):
            params = engine_params(request.params, self.tokenizer)
            for_engine.append(params)
            self.engine.check_request(request.request_id, request.prompt_ids, params, cache_salt=request.cache_salt,
                                      prompt_field=f"{prompt_field}[{i}]", params_field=f"{params_field}[{i}]")
        queued: list[str] = []
        try:
            for request, params in zip(requests, for_engine):
                self._add(request, params)
                queued.append(request.request_id)
        except BaseException:
            for request_id in queued:
                self.processor.abort(request_id)
                self.abort(request_id)
            raise

    def abort(self, request_id: str) -> None:
        """Stops a request in the engine; its final output (finish reason "abort") comes with the
        next step. A request that finished already, or was never added, is left alone."""
        try:
            self.engine.abort(request_id)
        except KeyError:
            pass

    def has_unfinished(self) -> bool:
        """True while the engine has work or an output left to report (`LLMEngine.has_unfinished`)."""
        return self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine step read by the processor: the outputs for users (samples that reached a stop
        string are ended in the engine before the next step)."""
        return self.processor.process(self.engine.step())

    def _add(self, request: TextRequest, params: SamplingParams | None) -> None:
        """`add`, with the engine's SamplingParams when computed already (None: computed here, after
        the processor took the request, so its refusals come first)."""
        self.processor.add_request(request.request_id, request.prompt_ids, request.params, request.prompt)
        try:
            if params is None:
                params = engine_params(request.params, self.tokenizer)
            self.engine.add_request(request.request_id, request.prompt_ids, params, cache_salt=request.cache_salt)
        except BaseException:
            self.processor.abort(request.request_id)
            raise
