"""What /v1/completions and /v1/chat/completions accept: every field of OpenAI's and vLLM's requests.

Models validate strictly (a bool is never a number, a number never a string) and forbid unknown
fields (OpenAI's "unrecognized request argument"). A field is honoured (mapped onto SamplingParams
or the prompt), accepted without effect where that is what it means here (`user`, `metadata`), or
accepted only at its neutral value (`fields.NEUTRAL_ONLY`); the sampling controls map onto
SamplingParams through `fields.sampling_controls`. Ranges are
OpenAI's or vLLM's; the engine's door checks the rest (n against max_num_seqs, prompt length).
Every error names its field: the server answers 400 with it as `param`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from jpaged.core.constraints import StructuredOutputsParams
from jpaged.core.sequence import MAX_LOGPROBS, SamplingParams
from jpaged.entrypoints.serve.errors import RequestError
from jpaged.entrypoints.serve.fields import CHAT_NEUTRAL_ONLY, check_neutral, sampling_controls
from jpaged.entrypoints.serve.structured import ResponseFormat, StructuredOutputsRequest, structured_spec

_STRICT = ConfigDict(extra="forbid", strict=True)
TokenIds = list[int]


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool | None = False  # a last chunk with the request's usage (choices empty)
    continuous_usage_stats: bool | None = False  # vLLM: usage so far in every chunk
    include_obfuscation: bool | None = None  # OpenAI's padding against length side channels: none is sent


class _Request(BaseModel):
    """Fields both generation routes share."""

    model_config = _STRICT

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # None: 1.0 (OpenAI's default), 0 for beams
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=2**32)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused (an end-user id for the provider's abuse checks)
    # The sampling controls (fields.CONTROLS), vLLM's names and ranges, honoured by SamplingParams
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    min_tokens: int = Field(0, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] = Field(default_factory=list)
    # vLLM's extensions, honoured
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: all tokens
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    length_penalty: float = 1.0
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep this many prompt tokens (-1: max_model_len)
    truncation_side: Literal["left", "right"] | None = None  # which end truncation cuts (default left: keep the end)
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # prefix-cache namespace
    request_id: str | None = Field(None, min_length=1, max_length=256)  # the response id's suffix
    return_tokens_as_token_ids: bool | None = None  # logprobs tokens as "token_id:<id>"
    return_token_ids: bool | None = None  # choices carry token_ids, and the prompt's
    # Per prompt position the prompt token's and the top k log-probabilities (vLLM's extension);
    # returned whole, so not with stream (vLLM refuses k > 0 with stream as well)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # SGLang's extensions, which sglang-router and vllm-router add to every request they forward:
    # accepted without effect (no reasoning parser splits anything out) or neutral only (fields.py)
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    no_stop_trim: bool = False
    return_hidden_states: bool = False
    # vLLM's extensions accepted without effect, as vLLM's generation routes
    session_id: str | None = None  # a router's affinity key
    return_token_offsets: bool | None = False  # render endpoints only
    mm_payload: Literal["tensors", "none"] = "tensors"  # render endpoints only
    return_mm_kwargs: bool | None = None  # render endpoints only
    stream_interval: int | None = Field(None, ge=1)  # below the server's --stream-interval: the server's
    # Structured outputs (structured.py), honoured: OpenAI's response_format or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # Neutral only (fields.NEUTRAL_ONLY)
    logprob_token_ids: TokenIds | None = None
    spaces_between_special_tokens: bool = True
    priority: int = 0
    watermarking: bool | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    routed_experts_prompt_start: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _check_shared(self) -> _Request:
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            raise RequestError("stream_options: only allowed with stream: true", "stream_options")
        if self.prompt_logprobs and self.stream:
            raise RequestError("prompt_logprobs: not available with stream: true (they come whole, at the end of the "
                               "prompt)", "prompt_logprobs")
        if isinstance(self.stop, list) and not all(self.stop):
            raise RequestError("stop: stop strings must be non-empty", "stop")
        for key in self.logit_bias or {}:
            if not key.isdigit():
                raise RequestError(f"logit_bias: keys must be token ids as strings, got {key!r}", "logit_bias")
        if any(not -100.0 <= b <= 100.0 for b in (self.logit_bias or {}).values()):
            raise RequestError("logit_bias: biases must be in [-100, 100]", "logit_bias")
        check_neutral(self)
        self.structured()  # a request that asks for two, or for none of structured_outputs' kinds
        return self

    def structured(self) -> tuple[StructuredOutputsParams, str] | None:
        """What the output must match and the request field that names it in errors, or None."""
        return structured_spec(self.response_format, self.structured_outputs)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                        stream_interval: int) -> SamplingParams:
        """The engine's SamplingParams (output_kind "delta" when streamed); `logprobs` and
        `prompt_logprobs` as the route reads them; `stream_interval` is the server's, which a request
        may not raise yet."""
        if self.stream_interval is not None and self.stream_interval > stream_interval:
            raise RequestError(f"stream_interval: a per-request interval above the server's ({stream_interval}) "
                               "is not supported yet", "stream_interval")
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        temperature = self.temperature if self.temperature is not None else (0.0 if self.use_beam_search else 1.0)
        structured = self.structured()  # compiled later, by the handler (structured.compiled)
        try:
            return SamplingParams(
                n=self.n, temperature=temperature, top_p=1.0 if self.top_p is None else self.top_p,
                top_k=max(self.top_k or 0, 0), max_tokens=max_tokens, seed=self.seed, stop=tuple(stop),
                stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                use_beam_search=self.use_beam_search, length_penalty=self.length_penalty,
                output_kind="delta" if self.stream else "final", **sampling_controls(self),
                structured_outputs=None if structured is None else structured[0])
        except (TypeError, ValueError) as exc:  # SamplingParams names its field: "SamplingParams.top_p: ..."
            if isinstance(exc, RequestError):
                raise
            text = str(exc).removeprefix("SamplingParams.")
            name = re.match(r"\w*", text).group()
            raise RequestError(text, name if name in type(self).model_fields else None) from None


class CompletionRequest(_Request):
    """POST /v1/completions."""

    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = Field(16, ge=0)  # None: what max_model_len leaves; 0 only with echo
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False  # the prompt before the completion (text, tokens and, with logprobs, theirs)
    best_of: int | None = Field(None, ge=1)  # a sampling control (fields.CONTROLS): the n best of best_of
    add_special_tokens: bool = True  # text prompts get what the tokenizer adds (BOS, usually)
    # Neutral only (fields.NEUTRAL_ONLY)
    suffix: str | None = None
    prompt_embeds: Any = None

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        if isinstance(self.prompt, list) and not self.prompt:
            raise RequestError("prompt: must not be empty", "prompt")
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens: must be at least 1 (0, the prompt alone, only with echo: true)",
                               "max_tokens")
        if self.best_of is not None and self.best_of < self.n:
            raise RequestError(f"best_of: must be >= n ({self.n}), got {self.best_of}", "best_of")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise RequestError(f"best_of: {self.best_of} > n ({self.n}) is not supported with stream: true (the n "
                               "best are known only at the end)", "best_of")
        return self

    @property
    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: as asked, else with echo the logprobs' k (vLLM's rule: an
        echo with logprobs carries the prompt's)."""
        return self.logprobs if self.prompt_logprobs is None and self.echo else self.prompt_logprobs

    def prompts(self) -> list[tuple[str | list[int], str]]:
        """(prompt, its field name) of each prompt: one string or id list, or a list of them."""
        p = self.prompt
        if isinstance(p, str) or isinstance(p[0], int):
            return [(p, "prompt")]
        return [(one, f"prompt[{i}]") for i, one in enumerate(p)]


class ChatMessage(BaseModel):
    """A chat message; fields beyond role and content (name, tool_calls, ...) go to the template."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)  # None: what max_model_len leaves
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Rendering the prompt (vLLM's extensions, honoured; see chat_prompt.py)
    add_generation_prompt: bool = True  # open the assistant's turn
    continue_final_message: bool = False  # leave the last message open: the model continues it
    add_special_tokens: bool = False  # what the tokenizer adds, on top of what the template writes
    documents: list[dict[str, str]] | None = None  # the template's `documents` (retrieval)
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None  # a template variable
    return_prompt_text: bool | None = None  # the response carries the rendered prompt
    tools: list[dict[str, Any]] | None = None  # the template's `tools`, with tool_choice "none" only
    tool_choice: str | dict[str, Any] | None = None
    # Accepted without effect
    parallel_tool_calls: bool | None = True  # no tool calls are made
    include_reasoning: bool = True  # no reasoning parser: nothing is split out
    metadata: dict[str, str] | None = None  # tags for stored completions; nothing is stored
    prompt_cache_key: str | None = None  # a routing hint for OpenAI's cache; the prefix cache matches by content
    safety_identifier: str | None = None  # like user
    # Neutral only (fields.NEUTRAL_ONLY; echo: fields.CHAT_NEUTRAL_ONLY, completions honour theirs)
    echo: bool = False  # vLLM's chat echo (prepend the last message)
    chat_template: str | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    store: bool | None = None
    service_tier: str | None = None
    verbosity: str | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs: needs logprobs: true", "top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise RequestError("max_completion_tokens: give max_tokens or max_completion_tokens, not both",
                               "max_completion_tokens")
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError("continue_final_message: cannot be combined with add_generation_prompt: true "
                               "(set it to false)", "continue_final_message")
        if self.tools == []:
            raise RequestError("tools: must not be an empty list (leave it out)", "tools")
        if self.tool_choice is not None and self.tool_choice != "none":
            raise RequestError("tool_choice: tool calls are not supported (no tool-call parser): only 'none'",
                               "tool_choice")
        if self.tools is not None and self.tool_choice is None:
            raise RequestError("tool_choice: with tools, OpenAI's default is 'auto', and tool calls are not "
                               "supported: send tool_choice 'none' (the tools still reach the chat template)",
                               "tool_choice")
        check_neutral(self, CHAT_NEUTRAL_ONLY)
        return self

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or the number of top tokens per position."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens, or the older max_tokens."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's shape): a prompt, or chat messages rendered by the template."""

    model_config = _STRICT

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (as vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False  # also the vocabulary entries of the ids
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    media_io_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("prompt: give a prompt or messages (one of them)", "prompt")
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError("continue_final_message: cannot be combined with add_generation_prompt: true",
                               "continue_final_message")
        check_neutral(self)
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's shape)."""

    model_config = _STRICT

    model: str | None = None
    tokens: TokenIds
