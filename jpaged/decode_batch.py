"""The running batch of decoding sequences, kept between steps while the running set is unchanged.

In the steady state of serving, step after step the same sequences each decode one token. What
every such step needs that depends only on *which* sequences run is computed once, when the set
changes (an admission, swap, fork or a prompt's last chunk), instead of once per step: the
sequences' block-table rows, the union of their stop tokens, and the step at which each
sequence reaches its length limit. With that, a step's stop checks are one set test for the
whole batch plus the rows known to reach their limit, and its input ids are the tokens the
previous step sampled. A preemption or a finish only removes sequences: the batch and its
cursor are cut (`kept`), not rebuilt (vLLM v1 keeps a persistent batch for the same reason).
Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np

from jpaged.sequence import Sequence, SequenceStatus
from jpaged.step_plan import bucket

if TYPE_CHECKING:
    from jpaged.kv_manager import KVCacheManager


class DecodeBatch:
    """Decoding sequences, FCFS, with what their steps share (see the module docstring)."""

    __slots__ = ("seqs", "token_lists", "rows", "padded_rows", "stop_tokens", "num_steps", "cursor", "_sampled",
                 "_sampled_step", "_steps_to_limit", "_steps_before_limit")

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
        # Each step appends one token to every sequence, so sequence i reaches its length limit
        # with the token of step `_steps_to_limit[i]` (i64[n]), and the first length stop is the
        # smallest. (operator.sub: the slot wrapper int.__sub__ costs five times more per call.)
        self._steps_to_limit = np.fromiter(map(operator.sub, [g.max_total_len for g in groups],
                                               map(len, self.token_lists)), np.int64, len(seqs))
        self._steps_before_limit = int(self._steps_to_limit.min()) if len(seqs) else 0
        # The KV manager's decode cursor over the rows (made at the first step that uses it; the
        # scheduler drops it when the rows get slots another way).
        self.cursor = None
        # [n] the tokens sampled by the batch's step `_sampled_step` (see `sampled`).
        self._sampled: list[int] | None = None
        self._sampled_step = -1

    def without_last(self, count: int) -> DecodeBatch:
        """The batch less its last `count` sequences (a preempted group); see `kept`."""
        return self.kept(slice(len(self.seqs) - count))

    def still_running(self) -> DecodeBatch:
        """The batch less the sequences that are no longer running (finished); see `kept`."""
        running = SequenceStatus.RUNNING
        keep = [i for i, seq in enumerate(self.seqs) if seq.status is running]
        return self if len(keep) == len(self.seqs) else self.kept(keep)

    def kept(self, keep: slice | list[int]) -> DecodeBatch:
        """The batch of its sequences `keep` (a slice, or batch indices, ascending), same step
        count, so that a change that only removes sequences rebuilds nothing. Its stop tokens stay
        those of the larger batch (a superset only sends more steps through the exact per-row
        checks); its cursor is this one's, cut. (A slice, the preemption case, cuts the lists
        without a pass over them.)"""
        index = keep if isinstance(keep, slice) else np.array(keep, np.int64)

        def take(items: list) -> list:
            return items[keep] if isinstance(keep, slice) else [items[i] for i in keep]

        kept = DecodeBatch.__new__(DecodeBatch)
        kept.seqs, kept.token_lists, kept.rows = take(self.seqs), take(self.token_lists), self.rows[index]
        kept.padded_rows = _padded(kept.rows)
        kept.stop_tokens, kept.num_steps = self.stop_tokens, self.num_steps
        kept._steps_to_limit = self._steps_to_limit[index]
        kept._steps_before_limit = int(kept._steps_to_limit.min()) if kept.seqs else 0
        kept.cursor = None if self.cursor is None else self.cursor.kept(index, kept.padded_rows)
        kept._sampled = None if self._sampled is None else take(self._sampled)
        kept._sampled_step = self._sampled_step
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

    def sampled(self, tokens: list[int]) -> None:
        """Records the tokens the current step sampled, one per sequence, all appended."""
        self._sampled, self._sampled_step = tokens, self.num_steps

    def last_tokens(self) -> list[int] | None:
        """[n] each sequence's last token, when the previous step recorded them (`sampled`): the
        next step's input ids without a pass over the token lists. None otherwise (then read
        `token_lists`): every step counts in `num_steps`, so a record is never stale."""
        return self._sampled if self._sampled_step == self.num_steps - 1 else None

    def length_stops(self) -> list[int]:
        """Batch indices of the sequences that reach their length limit with the token the current
        step samples (usually none): every other sequence can end only by sampling one of
        `stop_tokens`."""
        if self.num_steps < self._steps_before_limit:
            return []
        return (self._steps_to_limit <= self.num_steps).nonzero()[0].tolist()


def _padded(rows: np.ndarray) -> np.ndarray:
    """i64[bucket(n)] `rows` then zeros: padding rows read the reserved row 0."""
    padded = np.zeros(bucket(len(rows)), np.int64)
    padded[: len(rows)] = rows
    return padded
