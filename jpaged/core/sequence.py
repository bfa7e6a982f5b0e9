"""Requests as the scheduler sees them: SamplingParams, Sequence, SequenceGroup and their statuses.

A request becomes a SequenceGroup: one Sequence at admission, n after parallel sampling forks,
up to `n` live beams under beam search. Sequences of a group are scheduled and preempted
together (gang scheduling). The tokens of a sequence whose K/V is in the cache are the slots its
block-table row holds (the KV manager counts them): a step computes some of the rest (a prompt
chunk, or the one token sampled last).
Pure Python: no jax import.
"""

from __future__ import annotations

import dataclasses
import enum
import zlib
from collections.abc import Mapping
from typing import Literal

import numpy as np

from jpaged.config.checks import (
    FLOAT32_MAX,
    INT32_LIMIT,
    UINT32_LIMIT,
    check_bool,
    check_choice,
    check_float,
    check_int,
    check_token_ids,
    show,
)
from jpaged.core.constraints import StructuredOutputsParams, TokenConstraint

OutputKind = Literal["final", "delta", "cumulative"]
MAX_LOGPROBS = 20  # most top log-probabilities per token a request may ask for (OpenAI's chat limit)
# |length_penalty| bound: output_len ** length_penalty stays finite for any max_model_len the
# config allows (2**24 ** 10 = 2**240); useful values are 0.5-2.
MAX_LENGTH_PENALTY = 10.0
MAX_LOGIT_BIAS = 100.0  # |logit_bias| values, as OpenAI documents them (vLLM clamps to the same range)
# The sampler's fixed per-row list widths (jpaged.executors.logits_controls.ControlWidths): one
# compiled program serves every request, so wider lists are refused at the door.
MAX_LOGIT_BIAS_IDS = 256  # logit_bias entries per request
MAX_BANNED_IDS = 256  # ids banned in one step: one per bad word, and min_tokens' stop ids and EOS ids

# SamplingParams field -> its check (type and range; returns the value as a plain Python type).
# The bounds are the device's: top_k is int32, seeds uint32, temperature float32.
_FIELD_CHECKS = {
    "n": lambda f, v: check_int(f, v, 1),
    "use_beam_search": check_bool,
    "temperature": lambda f, v: check_float(f, v, 0.0, FLOAT32_MAX),
    "top_k": lambda f, v: check_int(f, v, 0, INT32_LIMIT, hi_open=True),
    "top_p": lambda f, v: check_float(f, v, 0.0, 1.0, lo_open=True),
    "max_tokens": lambda f, v: check_int(f, v, 1),
    "stop_token_ids": lambda f, v: tuple(check_token_ids(f, v, allow_empty=True)),
    "ignore_eos": check_bool,
    "seed": lambda f, v: None if v is None else check_int(f, v, 0, UINT32_LIMIT, hi_open=True),
    "length_penalty": lambda f, v: check_float(f, v, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY),
    "output_kind": lambda f, v: check_choice(f, v, ("final", "delta", "cumulative")),
    "logprobs": lambda f, v: None if v is None else check_int(f, v, 0, MAX_LOGPROBS),
    "prompt_logprobs": lambda f, v: None if v is None else check_int(f, v, 0, MAX_LOGPROBS),
    "stop": lambda f, v: _stop_strings(f, v),
    "include_stop_str_in_output": check_bool,
    "skip_special_tokens": check_bool,
    "presence_penalty": lambda f, v: check_float(f, v, -2.0, 2.0),
    "frequency_penalty": lambda f, v: check_float(f, v, -2.0, 2.0),
    "repetition_penalty": lambda f, v: check_float(f, v, 0.0, FLOAT32_MAX, lo_open=True),
    "logit_bias": lambda f, v: _logit_bias(f, v),
    "min_tokens": lambda f, v: check_int(f, v, 0, INT32_LIMIT, hi_open=True),
    "min_p": lambda f, v: check_float(f, v, 0.0, 1.0),
    "allowed_token_ids": lambda f, v: None if v is None else tuple(check_token_ids(f, v)),
    "bad_words": lambda f, v: _stop_strings(f, v),
    "bad_words_token_ids": lambda f, v: _token_sequences(f, v),
    "best_of": lambda f, v: None if v is None else check_int(f, v, 1),
    "constraint": lambda f, v: _constraint(f, v),
    "structured_outputs": lambda f, v: _structured_outputs(f, v),
}
# Fields whose values change what is sampled, with their neutral value: beam search honours none of
# them (it ranks the model's raw log-probabilities), and a request with all of them neutral runs
# the sampler's plain path.
_CONTROL_NEUTRALS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                     "logit_bias": None, "min_tokens": 0, "min_p": 0.0, "allowed_token_ids": None,
                     "bad_words": (), "bad_words_token_ids": (), "constraint": None,
                     "structured_outputs": None}


def active_controls(params: SamplingParams) -> list[str]:
    """The names of the controls `params` sets to other than their neutral value."""
    return [name for name, neutral in _CONTROL_NEUTRALS.items()
            if (getattr(params, name) is not None if neutral is None else getattr(params, name) != neutral)]


def _stop_strings(field: str, value) -> tuple[str, ...]:
    """Stop strings (or bad words) as a tuple of non-empty strs (one str is one, as in the OpenAI API)."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise TypeError(f"{field}: must be a str or a list of strs, got {show(value)}")
    if not all(value):
        raise ValueError(f"{field}: every entry must be a non-empty str, got {show(value)}")
    return tuple(value)


def _logit_bias(field: str, value) -> dict[int, float] | None:
    """logit_bias as {token id: bias} with int ids and finite float biases in [-100, 100] (None or
    an empty mapping: no bias). Ids are checked against the vocabulary at the engine's door."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"{field}: must be a dict of token id -> bias, got {type(value).__name__} {show(value)}")
    if len(value) > MAX_LOGIT_BIAS_IDS:
        raise ValueError(f"{field}: at most {MAX_LOGIT_BIAS_IDS} entries, got {len(value)}")
    bias = {check_int(f"{field} key", token, 0, INT32_LIMIT, hi_open=True):
            check_float(f"{field}[{token}]", b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS) for token, b in value.items()}
    return bias or None


def _token_sequences(field: str, value) -> tuple[tuple[int, ...], ...]:
    """A list of non-empty token-id lists as a tuple of tuples."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{field}: must be a list of token-id lists, got {type(value).__name__} {show(value)}")
    return tuple(tuple(check_token_ids(f"{field}[{i}]", ids)) for i, ids in enumerate(value))


def _constraint(field: str, value) -> TokenConstraint | None:
    if value is not None and not isinstance(value, TokenConstraint):
        raise TypeError(f"{field}: must implement jpaged.core.constraints.TokenConstraint (vocab_size, allowed, "
                        f"accept, is_terminated, fork) or be None, got {type(value).__name__}")
    if value is not None:
        check_int(f"{field}.vocab_size", value.vocab_size, 1, INT32_LIMIT, hi_open=True)
    return value


def _structured_outputs(field: str, value) -> StructuredOutputsParams | None:
    if value is not None and not isinstance(value, StructuredOutputsParams):
        raise TypeError(f"{field}: must be a jpaged.StructuredOutputsParams or None, got {type(value).__name__} "
                        f"{show(value)}")
    return value


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life; `label` is the finish reason reported to users."""

    WAITING = ("waiting", False)  # queued for (re)prefill: new, or preempted by recompute
    RUNNING = ("running", False)  # holds device blocks and is scheduled each step
    SWAPPED = ("swapped", False)  # preempted by swap: its blocks live in host memory
    FINISHED_STOPPED = ("stop", True)  # emitted a stop token
    FINISHED_LENGTH = ("length", True)  # reached max_tokens or max_model_len
    FINISHED_ABORTED = ("abort", True)  # aborted by the user, rejected, or dropped (beam search)

    def __init__(self, label: str, finished: bool):
        self.label = label
        # A plain attribute, not a property: it is read for every sequence of every step.
        self.is_finished = finished


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick output tokens. Every field is checked at construction (`_FIELD_CHECKS`): a wrong
    type raises TypeError, a value out of range ValueError, naming the field, the value and the range."""

    n: int = 1  # independent samples of the request (parallel sampling); beam width under beam search
    use_beam_search: bool = False  # keep the n most likely sequences (needs temperature 0)
    temperature: float = 0.0  # 0 = greedy; > 0 scales logits before sampling
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set of tokens with total probability >= top_p, in (0, 1]
    max_tokens: int = 16  # most tokens to generate
    stop_token_ids: tuple[int, ...] = ()  # generation stops after any of these (ignore_eos or not)
    ignore_eos: bool = False  # keep generating through the model's EOS ids (benchmarks: length = max_tokens)
    # An int fixes every draw with the sample's index and position: the same seed and prompt give the
    # same samples in any request. None: the engine's seed 0 with the request id (requests differ).
    seed: int | None = None
    length_penalty: float = 1.0  # beam search: score = cumulative logprob / length ** length_penalty
    output_kind: OutputKind = "final"  # step() reports the request: at the end, or every step (delta / cumulative)
    logprobs: int | None = None  # per output token, the log-probabilities of the sampled and top `logprobs` tokens
    # Per prompt position after the first, the log-probabilities of the prompt's own token and of the
    # top `prompt_logprobs` tokens there (vLLM's meaning), computed in the prefill that runs anyway.
    prompt_logprobs: int | None = None
    # Text-level options, applied by the front end (jpaged.text.output_processor), not the token-level core:
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one (finish reason "stop")
    include_stop_str_in_output: bool = False  # keep the stop string at the end of the text
    skip_special_tokens: bool = True  # leave special tokens (EOS, chat markers) out of the text
    # Sampling controls, as vLLM's SamplingParams names and defines them (applied on device, in this
    # order: allowed_token_ids, bad words, min_tokens, logit_bias, penalties; then temperature,
    # min_p, top_k, top_p). Greedy rows see them too (argmax of the processed logits).
    presence_penalty: float = 0.0  # in [-2, 2]: minus this for every token the output already holds
    frequency_penalty: float = 0.0  # in [-2, 2]: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # > 0: logits of tokens in the prompt or output: / it if > 0, * it if not
    logit_bias: dict[int, float] | None = dataclasses.field(default=None, hash=False)  # token id -> added to its logit
    min_tokens: int = 0  # stop ids and EOS cannot be sampled before the output holds this many tokens
    min_p: float = 0.0  # in [0, 1]: drop tokens less likely than min_p x the likeliest (after temperature)
    allowed_token_ids: tuple[int, ...] | None = None  # only these tokens may be sampled
    bad_words: tuple[str, ...] = ()  # words never completed (the text front end fills bad_words_token_ids)
    # Token-id sequences never completed: the last token of one is banned whenever the output ends
    # with the rest of it (vLLM's rule; the engine reads these, and refuses bad_words without them).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    best_of: int | None = None  # sample this many (>= n) and return the n with the best cumulative logprob
    # Structured outputs: what the output must match (a JSON schema, regex, choice or grammar); the
    # text front end compiles it into `constraint` with the model's tokenizer (the engine refuses it
    # uncompiled), or a caller gives the matcher itself (jpaged.core.constraints).
    structured_outputs: StructuredOutputsParams | None = None
    constraint: TokenConstraint | None = dataclasses.field(default=None, hash=False)

    def __post_init__(self) -> None:
        # A bad value must fail here, at the door, never inside a step that batches other requests.
        for name, check in _FIELD_CHECKS.items():
            object.__setattr__(self, name, check(f"SamplingParams.{name}", getattr(self, name)))
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens: must be <= max_tokens ({self.max_tokens}), "
                             f"got {self.min_tokens}")
        if self.structured_outputs is not None and self.constraint is not None:
            raise ValueError("SamplingParams.structured_outputs: give structured_outputs or constraint, not both")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"SamplingParams.best_of: must be >= n ({self.n}), got {self.best_of}")
        if self.best_of is not None and self.best_of > self.n and self.output_kind != "final":
            raise ValueError(f"SamplingParams.best_of={self.best_of} > n={self.n} needs output_kind 'final' (the "
                             f"n best are known only at the end), got output_kind={self.output_kind!r}")
        if self.use_beam_search:
            unsupported = active_controls(self)
            if self.best_of not in (None, self.n):
                unsupported.append("best_of")
            if unsupported:
                raise ValueError(f"SamplingParams.use_beam_search does not support {', '.join(unsupported)}")
        if self.use_beam_search and self.temperature != 0:
            raise ValueError(f"SamplingParams.use_beam_search needs temperature 0 (beam search is deterministic), "
                             f"got temperature={self.temperature}")
        if self.use_beam_search and (self.top_k != 0 or self.top_p != 1.0):
            raise ValueError("SamplingParams.use_beam_search does not combine with top_k / top_p sampling, "
                             f"got top_k={self.top_k}, top_p={self.top_p}")
        if self.logprobs is not None and self.use_beam_search:
            raise ValueError("SamplingParams.logprobs is not supported with use_beam_search")
        if self.stop and self.use_beam_search:
            raise ValueError("SamplingParams.stop strings are not supported with use_beam_search")


class Sequence:
    """One token stream: prompt plus generated tokens, with its running log-probability."""

    __slots__ = ("seq_id", "index", "prompt_len", "prompt_array", "token_ids", "cumulative_logprob",
                 "status", "block_keys", "group", "num_reported", "logprobs", "constraint", "history",
                 "draft_lag")

    def __init__(self, seq_id: int, prompt_token_ids: list[int], index: int = 0):
        self.seq_id = seq_id
        self.index = index  # which sample of its request (seeds its random stream; output order)
        self.prompt_len = len(prompt_token_ids)
        # i32[prompt_len] the prompt as an array, made once on arrival (as vLLM v1's input batch
        # keeps token ids in numpy): a prefill's token-id rows are slices of it, not list copies.
        self.prompt_array = np.array(prompt_token_ids, dtype=np.int32)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt then outputs (one list object for life)
        self.cumulative_logprob = 0.0
        self.status = SequenceStatus.WAITING
        # Prefix-cache keys of the full blocks so far (extended lazily; tokens only ever append).
        self.block_keys: list[tuple[int, ...]] = []
        self.group: SequenceGroup | None = None  # the request it belongs to (set by SequenceGroup)
        self.num_reported = 0  # output tokens already streamed (output_kind "delta")
        # SamplingParams.logprobs: per output token {token id: logprob}, the top ones then the sampled one.
        self.logprobs: list[dict[int, float]] | None = None
        self.constraint: TokenConstraint | None = None  # its own matcher (SamplingParams.constraint)
        self.history = None  # its tokens as an array, while penalties read them (jpaged.core.sampling_controls)
        # With a draft model: the tokens whose draft K/V is written, when fewer than those computed
        # (steps ran without the draft: jpaged.core.sched.draft_mirror); None when it is complete.
        self.draft_lag: int | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens."""
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        """How many tokens were generated."""
        return len(self.token_ids) - self.prompt_len

    def fork(self, seq_id: int, index: int) -> Sequence:
        """A copy under a new id sharing this sequence's history (its blocks are shared by the block manager)."""
        child = Sequence(seq_id, [], index)
        child.prompt_len, child.prompt_array = self.prompt_len, self.prompt_array
        child.token_ids = list(self.token_ids)
        child.cumulative_logprob = self.cumulative_logprob
        child.status = self.status
        child.block_keys = list(self.block_keys)
        child.group = self.group
        child.logprobs = None if self.logprobs is None else list(self.logprobs)
        child.constraint = None if self.constraint is None else self.constraint.fork()
        child.draft_lag = self.draft_lag
        return child


def request_stream(request_id: str) -> int:
    """A stable 31-bit base of the random streams of request `request_id` (one stream per sample index)."""
    return (zlib.crc32(request_id.encode("utf-8", "surrogatepass")) * 1_000_003) & 0x7FFFFFFF


@dataclasses.dataclass(eq=False)  # identity semantics: queues find and remove this very request
class SequenceGroup:
    """All sequences of one request, scheduled and preempted together."""

    request_id: str
    seqs: list[Sequence]  # live and finished sequences of the request
    sampling_params: SamplingParams
    arrival_time: float
    arrival_order: int  # FCFS rank: preemption picks the largest first
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    cache_salt: str | None = None  # prefix-cache namespace: groups with different salts never share blocks
    finished_beams: list[Sequence] = dataclasses.field(default_factory=list)  # beam search: completed hypotheses
    eos_token_ids: tuple[int, ...] = ()  # the model's end-of-sequence ids: stops unless ignore_eos

    def __post_init__(self) -> None:
        for seq in self.seqs:
            seq.group = self
        params = self.sampling_params
        # Stop checks run for every sequence every step: precompute what they read.
        # ignore_eos skips only the model's EOS ids: explicit stop_token_ids always stop.
        self.stop_set = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else self.eos_token_ids)
        self.max_total_len = self.seqs[0].prompt_len + params.max_tokens
        # Most sequences the group ever holds at once: samples (best_of of them) or beams.
        self.width = params.n if params.use_beam_search or params.best_of is None else params.best_of
        self.is_single = self.width == 1 and not params.use_beam_search  # one sequence for its whole life
        # The sampler's controls (jpaged.core.sampling_controls): does any apply, and min_tokens'
        # banned ids, every stop id and EOS even under ignore_eos (vLLM's all_stop_token_ids).
        # (min_p filters the random draw, which every batch runs; bad_words act through their ids.)
        self.has_controls = bool(set(active_controls(params)) - {"min_p", "bad_words"})
        self.min_tokens_banned = tuple(sorted(set(params.stop_token_ids) | set(self.eos_token_ids)))
        if params.constraint is not None:
            for seq in self.seqs:
                seq.constraint = params.constraint.fork()
        # Random draws: (seed, stream base + sample index, position). An explicit seed alone fixes them.
        self.seed = 0 if params.seed is None else params.seed
        self.stream_base = request_stream(self.request_id) if params.seed is None else 0
        self.num_forks = 0  # sequences forked so far (sample index of the next fork - 1)
        # SamplingParams.prompt_logprobs: per prompt position so far {token id: logprob} (the prompt's
        # token, then the top ones), position 0 None; and the rank of the prompt's token at each.
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.prompt_ranks: list[int | None] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_ranks = [None], [None]
        self.prompt_logprobs_reported = False  # output_kind "delta": they go out once
        self.error: str | None = None  # why the engine ended the request, if it did

    @property
    def prompt_len(self) -> int:
        """Tokens in the request's prompt."""
        return self.seqs[0].prompt_len

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while some prompt position it asked log-probabilities for has none yet."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.seqs[0].prompt_len

    def live_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        """Unfinished sequences, optionally only those with `status`."""
        if status is None:
            return [s for s in self.seqs if not s.status.is_finished]
        return [s for s in self.seqs if s.status is status]

    @property
    def is_finished(self) -> bool:
        """True when every sequence reached a terminal status."""
        return all(s.status.is_finished for s in self.seqs)

    @property
    def is_fresh(self) -> bool:
        """True before its prompt was ever sampled: one sequence, no output, no fork yet."""
        return len(self.seqs) == 1 and self.seqs[0].num_output_tokens == 0 and not self.finished_beams
