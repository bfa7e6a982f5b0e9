"""The text side of requests: token outputs of the engine become text outputs, stop strings end samples.

As in vLLM v1, detokenization and stop strings live in the front end, not in the token-level core:
the engine reports new tokens (output_kind "delta") every step a request moves, each sample's
`OutputText` turns them into text, and a sample whose text hits a stop string is ended in the
engine (`LLMEngine.finish_request`, finish reason "stop", blocks freed) before the next step, so it
never computes a token past the stop; once all its samples ended, the request is reported
finished. A request without stop strings that is not streamed asks the engine for its final
output only (no per-step work). Users get the output kind they asked for:
"final" (once, at the end), "delta" (new tokens and new text) or "cumulative" (everything so far).
Streamed text holds back a tail that could still become a stop string; `stream_interval` > 1
reports streams every few steps (vLLM's knob: fewer, larger chunks, less host work per token).
Pure Python, no jax.
"""

from __future__ import annotations

import dataclasses

from jpaged.core.outputs import CompletionOutput, RequestOutput
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.text.bad_words import with_bad_word_ids
from jpaged.text.output_text import OutputText
from jpaged.text.structured_output import with_constraint
from jpaged.text.tokenizer import Tokenizer


@dataclasses.dataclass
class _Sample:
    """One sample's text and everything it produced so far."""

    text: OutputText | None  # None without a tokenizer (token ids only)
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    sent_text: list[str] = dataclasses.field(default_factory=list)  # what take_delta returned (cumulative)
    num_sent: int = 0  # tokens already reported (delta)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    finish_sent: bool = False  # a delta stream reported the finish reason already


@dataclasses.dataclass
class _Request:
    params: SamplingParams  # as the user gave them (output_kind: what the user wants)
    prompt: str | None
    prompt_ids: list[int]
    samples: dict[int, _Sample] = dataclasses.field(default_factory=dict)
    steps_unreported: int = 0  # engine outputs since the user's last one (stream_interval)
    reported: bool = False  # the user got an output already (the first token goes out at once)


def engine_params(params: SamplingParams, tokenizer: Tokenizer | None = None) -> SamplingParams:
    """The SamplingParams the engine gets: per-step deltas when the text must be seen as it grows,
    bad words as token ids and structured outputs as a compiled constraint (with the model's
    `tokenizer`; a malformed schema, regex or grammar is a ValueError naming it)."""
    params = with_constraint(with_bad_word_ids(params, tokenizer), tokenizer)
    # (best_of > n ranks its samples at the end: their stop strings then cut the final texts only)
    needs_steps = params.output_kind != "final" or (bool(params.stop) and params.best_of in (None, params.n))
    return dataclasses.replace(params, output_kind="delta" if needs_steps else "final")


class OutputProcessor:
    """Per-request text state between an engine and its users (one per engine, on its thread)."""

    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer | None, stream_interval: int = 1):
        """`stream_interval` (vLLM's knob): a streamed request is reported at its first token, then
        every `stream_interval` engine steps, and when a sample or the request ends; 1 = every step."""
        if not (isinstance(stream_interval, int) and stream_interval >= 1):
            raise ValueError(f"stream_interval must be an int >= 1, got {stream_interval!r}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._requests: dict[str, _Request] = {}

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        """Starts tracking a request; the engine must get `engine_params(params)` for it."""
        if request_id in self._requests:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop: stop strings need a tokenizer (this model has none)")
        self._requests[request_id] = _Request(params, prompt, list(prompt_ids))

    def abort(self, request_id: str) -> None:
        """Forgets a request (its later engine outputs are ignored)."""
        self._requests.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def process(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Engine outputs (of one step) -> outputs for users; samples that reached a stop string
        are ended in the engine now, and a request whose samples all ended is reported finished."""
        user_outputs = []
        for out in outputs:
            request = self._requests.get(out.request_id)
            if request is None:  # finished at a stop string, or not ours
                continue
            stopped = [c.index for c in out.outputs if self._apply(request, c)]
            if stopped and not out.finished:
                self.engine.finish_request(out.request_id, stopped)
                params = request.params
                if (not params.use_beam_search and len(request.samples) == params.n
                        and all(s.finish_reason is not None for s in request.samples.values())):
                    # Done now: its final engine output, one step later, only frees what is freed.
                    out = dataclasses.replace(out, finished=True, finish_time=self.engine.executor.now())
            if out.finished:
                del self._requests[out.request_id]
            elif request.params.output_kind == "final":
                continue
            else:
                request.steps_unreported += 1
                if (request.reported and request.steps_unreported < self.stream_interval and not stopped
                        and not any(c.finish_reason for c in out.outputs)):
                    continue  # stream_interval: let the next steps' tokens join this one's
            request.steps_unreported, request.reported = 0, True
            user_outputs.append(self._user_output(request, out))
        return user_outputs

    def _apply(self, request: _Request, completion: CompletionOutput) -> bool:
        """Adds a completion's new tokens to its sample; True when a stop string ended it just now."""
        sample = request.samples.get(completion.index)
        if sample is None:
            params = request.params
            text = None if self.tokenizer is None else OutputText(
                self.tokenizer, stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                skip_special_tokens=params.skip_special_tokens, prompt_ids=request.prompt_ids)
            sample = request.samples[completion.index] = _Sample(text)
        if sample.finish_reason is not None:  # ended by a stop string: nothing after it counts
            return False
        sample.cumulative_logprob = completion.cumulative_logprob
        stop = None
        # A stop token id or EOS that ended the sample (its last new token): as in vLLM, the id stays
        # in token_ids but its text is left out unless include_stop_str_in_output.
        textless = len(completion.token_ids) - 1 if self._ended_by_stop_token(request.params, completion) else None
        for i, token in enumerate(completion.token_ids):
            if sample.text is not None and i != textless:
                stop = sample.text.add_token(token)
            if stop is not None:
                sample.token_ids += completion.token_ids[: i + 1]
                self._add_logprobs(sample, completion, i + 1)
                break
        else:
            sample.token_ids += completion.token_ids
            self._add_logprobs(sample, completion, len(completion.token_ids))
            if completion.finish_reason is not None and sample.text is not None:
                stop = sample.text.finish()  # the flushed bytes may still complete a stop string
        if stop is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop
            return completion.finish_reason is None
        if completion.finish_reason is not None:
            sample.finish_reason = completion.finish_reason
            last = sample.token_ids[-1] if sample.token_ids else None
            if completion.finish_reason == "stop" and last in request.params.stop_token_ids:
                sample.stop_reason = last  # vLLM: a stop token id is the reason; EOS is None
        return False

    def _ended_by_stop_token(self, params: SamplingParams, completion: CompletionOutput) -> bool:
        """True when the engine ended `completion` at a stop token id or EOS whose text is left out
        (not at a token that completed a structured output's grammar: that one is content)."""
        if completion.finish_reason != "stop" or not completion.token_ids or params.include_stop_str_in_output:
            return False
        last = completion.token_ids[-1]
        return last in params.stop_token_ids or (not params.ignore_eos and last in self.engine.eos_token_ids)

    @staticmethod
    def _add_logprobs(sample: _Sample, completion: CompletionOutput, count: int) -> None:
        if completion.logprobs is not None:
            if sample.logprobs is None:
                sample.logprobs = []
            sample.logprobs += completion.logprobs[:count]

    def _user_output(self, request: _Request, out: RequestOutput) -> RequestOutput:
        """The request's output in the kind its user asked for (text cut at stop strings)."""
        kind = request.params.output_kind
        completions = []
        for index in sorted(request.samples):
            sample = request.samples[index]
            finish = sample.finish_reason
            if kind == "delta":
                start, sample.num_sent = sample.num_sent, len(sample.token_ids)
                token_ids, text = sample.token_ids[start:], self._take_text(sample)
                logprobs = None if sample.logprobs is None else sample.logprobs[start:]
                if sample.num_sent == start and not text and (finish is None or sample.finish_sent):
                    continue  # nothing new for this sample
                sample.finish_sent = finish is not None
            else:
                token_ids, logprobs = list(sample.token_ids), sample.logprobs
                if kind == "cumulative":
                    self._take_text(sample)
                    text = "".join(sample.sent_text)
                else:
                    text = sample.text.text if sample.text is not None else ""
            completions.append(CompletionOutput(index, token_ids, sample.cumulative_logprob, finish, logprobs, text,
                                                sample.stop_reason if finish is not None else None))
        return RequestOutput(out.request_id, request.prompt_ids, completions, out.finished, out.arrival_time,
                             out.first_scheduled_time, out.first_token_time, out.finish_time, out.error,
                             request.prompt, out.prompt_logprobs, out.prompt_ranks)

    @staticmethod
    def _take_text(sample: _Sample) -> str:
        if sample.text is None:
            return ""
        delta = sample.text.take_delta()
        if delta:
            sample.sent_text.append(delta)
        return delta


def prompt_ids(prompt: str | list[int], tokenizer: Tokenizer | None,
               field: str = "prompt") -> tuple[list[int], str | None]:
    """(token ids, text or None) of a prompt given as text or as token ids; errors name `field`."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{field}: text prompts need a tokenizer (this model has none: pass token ids)")
        if not prompt:
            raise ValueError(f"{field}: is empty")
        return tokenizer.encode(prompt, field=field), prompt
    if isinstance(prompt, (list, tuple)) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt), None
    raise ValueError(f"{field}: must be a non-empty string or a non-empty list of token ids, got {prompt!r:.80}")
