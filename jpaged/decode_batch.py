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

import operator
from typing import TYPE_CHECKING

import numpy as np

from jpaged.sequence import Sequence
from jpaged.step_plan import bucket

if TYPE_CHECKING:
    from jpaged.kv_manager import KVCacheManager


class DecodeBatch:
    """Decoding sequences, FCFS, with what their steps share (see the module docstring)."""

    __slots__ = ("seqs", "token_lists", "rows", "padded_rows", "stop_tokens", "num_steps", "cursor",
                 "_steps_before_limit")

    def __init__(self, seqs: list[Sequence], rows: np.ndarray):
        self.seqs = seqs
        # Each sequence's token list (the same list object for its whole life): the step reads
        # and appends through these without per-row attribute lookups.
        self.token_lists = [s.token_ids for s in seqs]
        self.rows = rows  # i64[n] block-table row of each sequence
        self.padded_rows = _padded(rows)  # i64[S] the rows, then reserved row 0 up to the step's padded size
        groups = [s.group for s in seqs]
        self.stop_tokens: frozenset[int] = frozenset().union(*[g.stop_set for g in groups])
        self.num_steps = 0  # decode steps scheduled for this batch so far
        # Each step appends one token to every sequence, so the first length stop is the step
        # that brings the sequence with the fewest tokens left to its limit. (operator.sub: the
        # slot wrapper int.__sub__ costs five times more per call.)
        self._steps_before_limit = min(map(operator.sub, [g.max_total_len for g in groups], map(len, self.token_lists)),
                                       default=0)
        # The KV manager's decode cursor over the rows (made at the first step that uses it; the
        # scheduler drops it when the rows get slots another way).
        self.cursor = None

    def without_last(self, count: int) -> DecodeBatch:
        """The batch less its last `count` sequences (a preempted group), same step count. Its stop
        tokens and length limit stay those of the larger batch: a superset of the stop tokens and
        an earlier limit only send more steps through the exact per-row checks. Its cursor is
        this one's, cut."""
        kept = DecodeBatch.__new__(DecodeBatch)
        kept.seqs, kept.token_lists, kept.rows = self.seqs[:-count], self.token_lists[:-count], self.rows[:-count]
        kept.padded_rows = _padded(kept.rows)
        kept.stop_tokens, kept.num_steps = self.stop_tokens, self.num_steps
        kept._steps_before_limit = self._steps_before_limit
        kept.cursor = None if self.cursor is None else self.cursor.without_last(count, kept.padded_rows)
        return kept

    def step(self, kv: KVCacheManager) -> tuple[np.ndarray, np.ndarray] | None:
        """One decode token per sequence through the cursor: the step's (i32[3, S] positions /
        slots / context lengths, i32[S, M] block tables), or None (nothing changed) when the
        pool is out of blocks."""
        if self.cursor is None:
            self.cursor = kv.decode_cursor(self.rows, self.padded_rows)
        arrays = self.cursor.step()
        if arrays is not None:
            self.num_steps += 1
        return arrays

    def advance(self) -> None:
        """Counts one more decode step of the whole batch, whose slots came another way
        (`append_slots`: chunks or forks in the step); the cursor no longer holds."""
        self.num_steps += 1
        self.cursor = None

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
