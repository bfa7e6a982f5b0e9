"""What the engine reports about a request: its samples so far, or in the end (vLLM's shapes)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    """One sample (or beam) of a request."""

    index: int  # which sample of the request (beams: rank, best first)
    token_ids: list[int]  # generated tokens: all so far, or only the new ones (output_kind "delta")
    cumulative_logprob: float  # sum of the log-probabilities of its tokens under the model
    finish_reason: str | None  # "stop", "length" or "abort"; None while it runs
    # SamplingParams.logprobs: per token (the same ones as token_ids) {token id: logprob}, the top
    # `logprobs` tokens best first, then the sampled token if it is not among them; None otherwise
    # (and from an executor without a model).
    logprobs: list[dict[int, float]] | None = None
    # Filled by the text front end (jpaged.text.output_processor); the token-level engine leaves them:
    text: str = ""  # the generated text (all so far, or the new part when streaming deltas)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it, if any


@dataclasses.dataclass
class RequestOutput:
    """A request's state as reported by `LLMEngine.step()`: at the end, or every step when streaming."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # n samples (by index), or beams (best first)
    finished: bool  # True once: the request is done and its blocks are freed
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    error: str | None = None  # why the engine ended the request, if it did
    prompt: str | None = None  # the prompt text, when the front end was given text
    # SamplingParams.prompt_logprobs, once the prompt is computed (vLLM's shape): per prompt position
    # {token id: logprob}, the prompt's token first, then the top k best first; None at position 0.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # [prompt_len] the prompt token's rank at each position (None at 0)

    @property
    def output_token_ids(self) -> list[list[int]]:
        """Generated tokens of every sample, in `outputs` order."""
        return [c.token_ids for c in self.outputs]

    @property
    def finish_reasons(self) -> list[str | None]:
        """Finish reason of every sample, in `outputs` order."""
        return [c.finish_reason for c in self.outputs]
