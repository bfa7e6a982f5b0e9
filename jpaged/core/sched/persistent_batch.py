"""The running batch of decoding sequences, kept and edited in place from step to step.

In the steady state of serving, step after step the same sequences each decode one token. What
every such step needs that depends only on *which* sequences run is kept with the batch instead
of recomputed per step: the sequences' block-table rows, the union of their stop tokens, and the
step at which each sequence reaches its length limit. With that, a step's stop checks are one set
test for the whole batch plus the rows known to reach their limit, and its input ids are the
tokens the previous step sampled. The running set changes by events (an admission, a prompt's
last chunk, a swap-in, a finish, a preemption), and each edits the batch and its cursor in place:
`add` appends sequences, `discard` removes them, the last row moving into the hole (vLLM v1's
persistent input batch condenses the same way), so rows are in no particular order. The
running set (`jpaged.core.sched.running_set`) rebuilds it instead where order matters: on a fork,
and on a removal while a group with several sequences runs (beam ranks follow its rows' order).
Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Iterable

import numpy as np

from jpaged.core.sequence import Sequence

if TYPE_CHECKING:
    from jpaged.core.kv.kv_manager import KVCacheManager

_NEVER = 1 << 62  # no length limit ahead


class PersistentBatch:
    """Decoding sequences with what their steps share (see the module docstring)."""

    __slots__ = ("kv", "seqs", "token_lists", "stop_tokens", "num_steps", "cursor", "_index", "_rows",
                 "_limits", "_next_limit", "_recount", "_sampled", "_sampled_step", "_lists_out")

    def __init__(self, kv: KVCacheManager, seqs: Iterable[Sequence] = ()):
        self.kv = kv
        self.seqs: list[Sequence] = []  # [n] in batch order
        # Each sequence's token list (the same list object for its whole life): the step reads
        # and appends through these without per-row attribute lookups.
        self.token_lists: list[list[int]] = []
        self._lists_out = False  # a plan holds `seqs` and `token_lists`: copy them before an edit
        self.stop_tokens: frozenset[int] = frozenset()  # a superset of the sequences' stop tokens
        self.num_steps = 0  # decode steps scheduled for this batch so far
        # The KV manager's decode cursor over the rows (made at the first step that uses it;
        # dropped when the rows get slots another way: `advance`).
        self.cursor = None
        self._index: dict[int, int] = {}  # seq id -> batch index
        self._rows: list[int] = []  # [n] block-table row of each sequence
        # [n] the step whose token brings each sequence to its length limit (each step appends
        # one token to every sequence), and a lower bound of the first of them. (Plain lists: an
        # event edits an entry or two, which costs less than on an array.)
        self._limits: list[int] = []
        self._next_limit = _NEVER
        self._recount = False  # the sequences gained tokens unevenly: count `_limits` again at the next step
        # [n] the tokens sampled by the batch's step `_sampled_step` (see `sampled`).
        self._sampled: list[int] | None = None
        self._sampled_step = -1
        self.add(seqs)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def rows(self) -> np.ndarray:
        """i64[n] block-table row of each sequence."""
        return np.array(self._rows, np.int64)

    def add(self, seqs: Iterable[Sequence]) -> None:
        """Appends those of `seqs` not in the batch yet: resident sequences, each holding the slots
        of its context but its last token (it decodes that token next), none with forked siblings
        while a cursor runs."""
        kv, cursor = self.kv, self.cursor
        for seq in seqs:
            if seq.seq_id in self._index:
                continue
            if self._lists_out:
                self._own_lists()
            row = kv.rows.row_of(seq.seq_id)
            self._index[seq.seq_id] = len(self.seqs)
            self.seqs.append(seq)
            self.token_lists.append(seq.token_ids)
            self._rows.append(row)
            group = seq.group
            limit = self.num_steps + group.max_total_len - len(seq.token_ids)
            self._limits.append(limit)
            if limit < self._next_limit:
                self._next_limit = limit
            if not group.stop_set <= self.stop_tokens:
                self.stop_tokens = self.stop_tokens | group.stop_set
            if cursor is not None:
                cursor.add(row)
            self._sampled = None

    def discard(self, seqs: Iterable[Sequence]) -> None:
        """Removes those of `seqs` that are in the batch; the last rows move into their places. The
        stop tokens stay a superset (a larger one only sends more steps through the per-row checks)."""
        index, cursor = self._index, self.cursor
        for seq in seqs:
            i = index.pop(seq.seq_id, None)
            if i is None:
                continue
            if self._lists_out:
                self._own_lists()
            last = len(self.seqs) - 1
            if i != last:
                moved = self.seqs[i] = self.seqs[last]
                self.token_lists[i] = self.token_lists[last]
                index[moved.seq_id] = i
                self._rows[i] = self._rows[last]
                self._limits[i] = self._limits[last]
            self.seqs.pop()
            self.token_lists.pop()
            self._rows.pop()
            self._limits.pop()
            if cursor is not None:
                cursor.remove(i)
            self._sampled = None

    def handed_out(self) -> tuple[list[Sequence], list[list[int]]]:
        """(seqs, token_lists) for a plan to keep: the batch copies them before its next edit."""
        self._lists_out = True
        return self.seqs, self.token_lists

    def _own_lists(self) -> None:
        self.seqs, self.token_lists, self._lists_out = list(self.seqs), list(self.token_lists), False

    def step(self) -> tuple[np.ndarray, np.ndarray] | None:
        """One decode token per sequence through the cursor: the step's (i32[3, S] positions /
        slots / context lengths, i32[S, M] block tables), or None (nothing changed) when the
        pool is out of blocks."""
        if self.cursor is None:
            self.cursor = self.kv.decode_cursor(self._rows)
        arrays = self.cursor.step()
        if arrays is not None:
            if self._recount:
                self._recount_limits()
            self.num_steps += 1
        return arrays

    def blocks_needed(self) -> int:
        """Blocks the next `step` takes."""
        if self.cursor is None:
            self.cursor = self.kv.decode_cursor(self._rows)
        return self.cursor.blocks_needed()

    def advance(self, uneven: bool = False) -> None:
        """Counts one more decode step of the whole batch, whose slots came another way
        (`append_slots`: chunks or forks in the step); the cursor no longer holds. `uneven`: the
        step gives its sequences different numbers of tokens (a verify step of speculative
        decoding), so the next step counts their length limits again from their lengths."""
        self.num_steps += 1
        self.cursor = None
        self._recount = self._recount or uneven

    def _recount_limits(self) -> None:
        """`_limits` from the sequences' lengths now, as `add` counts them (before the step that
        starts is counted)."""
        now = self.num_steps
        self._limits = [now + seq.group.max_total_len - len(tokens) for seq, tokens in zip(self.seqs, self.token_lists)]
        self._next_limit = min(self._limits, default=_NEVER)
        self._recount = False

    def sampled(self, tokens: list[int]) -> None:
        """Records the tokens the current step sampled, one per sequence, all appended."""
        self._sampled, self._sampled_step = tokens, self.num_steps

    def forget_sampled(self) -> None:
        """Drops the recorded tokens: recorded after the batch's next step was scheduled (the
        overlapped loop feeds that step its input ids itself), they would pass for that step's."""
        self._sampled = None

    def last_tokens(self) -> list[int] | np.ndarray:
        """[n] each sequence's last token: the step's input ids. The tokens the previous step
        recorded (`sampled`), when the batch did not change since (every step counts in
        `num_steps`, so a record is never stale); else read from the token lists."""
        if self._sampled_step == self.num_steps - 1 and self._sampled is not None:
            return self._sampled
        # (fromiter beats a list comprehension's setitem here)
        return np.fromiter(map(operator.itemgetter(-1), self.token_lists), np.int32, len(self.token_lists))

    def length_stops(self) -> list[int]:
        """Batch indices of the sequences that reach their length limit with the token the current
        step samples (usually none): every other sequence can end only by sampling one of
        `stop_tokens`."""
        now = self.num_steps
        if now < self._next_limit:
            return []
        first = min(self._limits, default=_NEVER)
        if first > now:  # (the sequences that set the bound left the batch)
            self._next_limit = first
            return []
        # These end with this step and leave the batch: look again at the next step.
        self._next_limit = now + 1
        return [i for i, limit in enumerate(self._limits) if limit <= now]
