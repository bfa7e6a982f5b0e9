"""The OpenAI request bodies the server accepts, validated at the door, and their SamplingParams.

Pydantic checks every field's type and range; a field the server does not know is an error
(OpenAI answers "Unrecognized request argument"), and a known OpenAI field that jpaged does not
implement is accepted only at its neutral value (presence_penalty 0, echo false, ...), so no
request is silently served differently from what it asked. vLLM's extensions that map onto
SamplingParams are accepted too (top_k, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens). Every error names its field: the server answers 400 with it as `param`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jpaged.core.sequence import MAX_LOGPROBS, SamplingParams


class RequestError(ValueError):
    """A request the server refuses (400), with the OpenAI field at fault (or None)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.kind = message, param, status, kind


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False  # a last chunk with the request's usage (choices empty)


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = Field(1, ge=1, le=256)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: 1.0, as OpenAI
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**32)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not implemented: only 0")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not implemented: only 0")
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="not implemented")
    # vLLM's extensions
    top_k: int = Field(0, ge=-1)  # 0 or -1: all tokens
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        if isinstance(self.stop, list) and not all(self.stop):
            raise ValueError("stop: stop strings must be non-empty")
        return self

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams (output_kind "delta" when streamed)."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        try:
            return SamplingParams(
                n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=max(self.top_k, 0),
                max_tokens=max_tokens, seed=self.seed, stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids),
                ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, logprobs=logprobs,
                output_kind="delta" if self.stream else "final")
        except ValueError as exc:  # SamplingParams names its field first ("top_p must be ...")
            name = str(exc).split(" ", 1)[0].split(":", 1)[0]
            raise RequestError(str(exc), name if name in type(self).model_fields else None) from None


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)  # None: what max_model_len leaves
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, description="not implemented: only false")
    suffix: str | None = Field(None, max_length=0, description="not implemented")
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo: not supported (only false)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of == n is supported")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: a string, a list of strings, token ids, or a list of token id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_calls, ...: passed to the chat template

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: what max_model_len leaves
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's extension: open the assistant's turn
    tool_choice: Literal["none"] | None = None  # tools are not implemented

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("max_completion_tokens: give max_tokens or max_completion_tokens, not both")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or the number of top tokens per position."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the chat template sees them (unset fields left out)."""
        return [m.model_dump(exclude_none=True) for m in self.messages]


def pydantic_error(errors: list[dict[str, Any]]) -> RequestError:
    """The first pydantic validation error as a RequestError naming its field ("messages[0].role")."""
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else str(part))
    message = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return RequestError(f"the request body is not valid JSON: {message}", None)
    if first.get("type") == "extra_forbidden":
        return RequestError(f"{param}: unrecognized request argument", param or None)
    if first.get("type") == "missing":
        return RequestError(f"{param}: field required", param or None)
    shown = repr(first.get("input"))
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    text = message.removeprefix("Value error, ")
    if not param and ":" in text:  # a model validator's error: "<field>: why"
        head = text.split(":", 1)[0]
        param = head if head.isidentifier() else ""
    elif param:
        text = f"{param}: {text} (got {shown})"
    return RequestError(text, param or None)
