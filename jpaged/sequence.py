"""Requests as the scheduler sees them: SamplingParams, Sequence, SequenceGroup and their statuses.

A request becomes a SequenceGroup: one Sequence at admission, n after parallel sampling forks,
up to `beam_width` live beams under beam search. Sequences of a group are scheduled and preempted
together (gang scheduling). Pure Python: no jax import.
"""

from __future__ import annotations

import dataclasses
import enum


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life; `label` is the finish reason reported to users."""

    WAITING = ("waiting", False)  # queued for (re)prefill: new, or preempted by recompute
    RUNNING = ("running", False)  # holds device blocks and is decoded each step
    SWAPPED = ("swapped", False)  # preempted by swap: its blocks live in host memory
    FINISHED_STOPPED = ("stop", True)  # emitted a stop token
    FINISHED_LENGTH = ("length", True)  # reached max_tokens or max_model_len
    FINISHED_ABORTED = ("abort", True)  # aborted by the user, or rejected

    def __init__(self, label: str, finished: bool):
        self.label = label
        # A plain attribute, not a property: it is read for every sequence of every step.
        self.is_finished = finished


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick output tokens. Validation errors name the field and its allowed range."""

    n: int = 1  # independent samples of the request (parallel sampling); beam width under beam search
    use_beam_search: bool = False  # keep the n most likely sequences (needs temperature 0)
    temperature: float = 0.0  # 0 = greedy; > 0 scales logits before sampling
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    top_p: float = 1.0  # keep the smallest set of tokens with total probability >= top_p, in (0, 1]
    max_tokens: int = 16  # most tokens to generate
    stop_token_ids: tuple[int, ...] = ()  # generation stops after any of these (unless ignore_eos)
    ignore_eos: bool = False  # keep generating through stop tokens (benchmarks: length = max_tokens)
    seed: int = 0  # with the request id and position, fixes every random draw
    length_penalty: float = 1.0  # beam search: score = cumulative logprob / length ** length_penalty

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.use_beam_search and self.temperature != 0:
            raise ValueError(f"use_beam_search needs temperature 0 (beam search is deterministic), "
                             f"got temperature={self.temperature}")
        if self.use_beam_search and (self.top_k != 0 or self.top_p != 1.0):
            raise ValueError("use_beam_search does not combine with top_k / top_p sampling")

    @property
    def is_greedy(self) -> bool:
        """True when every token is the argmax (no randomness)."""
        return self.temperature == 0.0 and not self.use_beam_search


class Sequence:
    """One token stream: prompt plus generated tokens, with its running log-probability."""

    __slots__ = ("seq_id", "prompt_len", "token_ids", "cumulative_logprob", "status", "parent_id", "block_keys",
                 "group")

    def __init__(self, seq_id: int, prompt_token_ids: list[int], parent_id: int | None = None):
        self.seq_id = seq_id
        self.prompt_len = len(prompt_token_ids)
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt then outputs
        self.cumulative_logprob = 0.0
        self.status = SequenceStatus.WAITING
        self.parent_id = parent_id
        # Prefix-cache keys of the full blocks so far (extended lazily; tokens only ever append).
        self.block_keys: list[tuple[int, ...]] = []
        self.group: SequenceGroup | None = None  # the request it belongs to (set by SequenceGroup)

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

    def fork(self, seq_id: int) -> Sequence:
        """A copy under a new id sharing this sequence's history (its blocks are shared by the block manager)."""
        child = Sequence(seq_id, [], parent_id=self.seq_id)
        child.prompt_len = self.prompt_len
        child.token_ids = list(self.token_ids)
        child.cumulative_logprob = self.cumulative_logprob
        child.status = self.status
        child.block_keys = list(self.block_keys)
        child.group = self.group
        return child


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

    def __post_init__(self) -> None:
        for seq in self.seqs:
            seq.group = self
        params = self.sampling_params
        # Stop checks run for every sequence every step: precompute what they read.
        self.stop_set = frozenset(() if params.ignore_eos else params.stop_token_ids)
        self.max_total_len = self.seqs[0].prompt_len + params.max_tokens
        self.is_single = params.n == 1 and not params.use_beam_search  # one sequence for its whole life

    @property
    def prompt_len(self) -> int:
        """Tokens in the request's prompt."""
        return self.seqs[0].prompt_len

    def live_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        """Unfinished sequences, optionally only those with `status`."""
        if status is None:
            return [s for s in self.seqs if not s.status.is_finished]
        return [s for s in self.seqs if s.status is status]

    @property
    def is_finished(self) -> bool:
        """True when every sequence reached a terminal status."""
        return all(s.status.is_finished for s in self.seqs)
