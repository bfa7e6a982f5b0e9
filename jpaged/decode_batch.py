"""The running batch of decoding sequences, kept between steps while the running set is unchanged.

In the steady state of serving, step after step the same sequences each decode one token. What
every such step needs that depends only on *which* sequences run is computed once, when the set
changes (an admission, preemption, swap, fork or finish), instead of once per step: the
sequences' block-table rows, the union of their stop tokens, and how many more steps the batch
can take before any sequence reaches its length limit. With that, a step's stop checks are one
set test for the whole batch unless a limit is near (vLLM v1 keeps a persistent batch for the
same reason). Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import numpy as np

from jpaged.sequence import Sequence
from jpaged.step_plan import bucket


class DecodeBatch:
    """Decoding sequences, FCFS, with what their steps share (see the module docstring)."""

    __slots__ = ("seqs", "token_lists", "rows", "padded_rows", "stop_tokens", "num_steps", "_steps_before_limit",
                 "_longest")

    def __init__(self, seqs: list[Sequence], rows: np.ndarray):
        self.seqs = seqs
        # Each sequence's token list (the same list object for its whole life): the step reads
        # and appends through these without per-row attribute lookups.
        self.token_lists = [s.token_ids for s in seqs]
        self.rows = rows  # i64[n] block-table row of each sequence
        self.padded_rows = _padded(rows)  # i64[S] the rows, then reserved row 0 up to the step's padded size
        groups = [s.group for s in seqs]
        lengths = [len(s.token_ids) for s in seqs]
        self.stop_tokens: frozenset[int] = frozenset().union(*[g.stop_set for g in groups])
        self.num_steps = 0  # decode steps scheduled for this batch so far
        # Each step appends one token to every sequence, so the first length stop is the step
        # that brings the sequence with the fewest tokens left to its limit.
        self._steps_before_limit = min(map(int.__sub__, [g.max_total_len for g in groups], lengths), default=0)
        self._longest: int | None = max(lengths, default=0)  # longest context at the first step

    def without_last(self, count: int) -> DecodeBatch:
        """The batch less its last `count` sequences (a preempted group), same step count. Its stop
        tokens and length limit stay those of the larger batch: a superset of the stop tokens and
        an earlier limit only send more steps through the exact per-row checks. Its longest
        context is no longer known (None)."""
        kept = DecodeBatch.__new__(DecodeBatch)
        kept.seqs, kept.token_lists, kept.rows = self.seqs[:-count], self.token_lists[:-count], self.rows[:-count]
        kept.padded_rows = _padded(kept.rows)
        kept.stop_tokens, kept.num_steps = self.stop_tokens, self.num_steps
        kept._steps_before_limit, kept._longest = self._steps_before_limit, None
        return kept

    def advance(self) -> None:
        """Counts one more decode step of the whole batch (its sequences got their slots)."""
        self.num_steps += 1

    @property
    def longest_context(self) -> int | None:
        """The longest context (tokens with a slot) in the current step; None when unknown."""
        return None if self._longest is None else self._longest + self.num_steps - 1

    @property
    def stops_only_by_token(self) -> bool:
        """True when no sequence reaches its length limit with the token the current step samples:
        then only sampling one of `stop_tokens` can end a sequence."""
        return self.num_steps < self._steps_before_limit


def _padded(rows: np.ndarray) -> np.ndarray:
    """i64[bucket(n)] `rows` then zeros: padding rows read the reserved row 0."""
    padded = np.zeros(bucket(len(rows)), np.int64)
    padded[: len(rows)] = rows
    return padded
