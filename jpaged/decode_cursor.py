"""Decode cursors: one slot per sequence per step for the running batch, without per-step gathers.

A steady decode step gives every running sequence one more KV slot and hands the executor each
row's position, slot and context length, plus the block tables. All of that changes by +1 per
step except at a block boundary, and each row reaches its next boundary exactly every
`block_size` steps. `PagedDecodeCursor` keeps the next step's arrays and how many steps remain
before the next row crosses a boundary, so a step is one array add, plus finding and opening
blocks for the rows that cross on the steps where some do. `AppendCursor` is the
generic form over any `KVCacheManager.append_slots` (the contiguous baselines use it).

A cursor is valid while its rows get slots only through it: it is cut with its batch when the
latest-arrived group is preempted or sequences finish (`kept`), and the scheduler drops it when
the running set changes otherwise or the rows get slots another way (chunks in the same step,
forks). It never writes into a shared block: the batch has no forked sequences, and prefix-cache
sharing covers whole blocks only. Pure numpy: no jax import.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from jpaged.step_plan import bucket

if TYPE_CHECKING:
    from jpaged.block_manager import BlockManager
    from jpaged.kv_manager import KVCacheManager


@functools.lru_cache(maxsize=1024)
def _increment(n: int, size: int) -> np.ndarray:
    """i32[3, size]: +1 to the position, slot and context length of the n real rows (read-only)."""
    inc = np.zeros((3, size), np.int32)
    inc[:, :n] = 1
    inc.flags.writeable = False
    return inc


def _table_width(kv: KVCacheManager, num_blocks: int) -> int:
    """Block-table columns of a step whose longest row uses `num_blocks` blocks (bucketed)."""
    return min(bucket(num_blocks), kv.max_blocks_per_seq)


class AppendCursor:
    """The generic cursor: `append_slots` each step, then the step's arrays gathered from the
    manager's tables (any `KVCacheManager`)."""

    def __init__(self, kv: KVCacheManager, rows: np.ndarray, padded_rows: np.ndarray):
        self.kv, self.rows, self.padded_rows = kv, rows, padded_rows

    def kept(self, keep: np.ndarray | slice, padded_rows: np.ndarray) -> AppendCursor:
        """The cursor of the batch's rows `keep` (i64[m] batch indices, ascending, or a slice), padded
        to `padded_rows`."""
        return AppendCursor(self.kv, self.rows[keep], padded_rows)

    def step(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(i32[3, S] positions / slots / context lengths, i32[S, M] block tables) of one more
        token per row, padding rows zero; None (nothing changed) when blocks run out."""
        kv, n = self.kv, len(self.rows)
        appended = kv.append_slots(self.rows, may_share=False)
        if appended is None:
            return None
        state = np.zeros((3, len(self.padded_rows)), np.int32)
        state[2] = kv.num_tokens.take(self.padded_rows)
        np.subtract(state[2, :n], 1, out=state[0, :n])
        state[1, :n] = appended[0]
        longest = int(state[2, :n].max()) if n else 1
        tables = kv.block_tables.take(self.padded_rows, axis=0)
        width = _table_width(kv, -(-longest // kv.block_size))
        return state, (tables if width == tables.shape[1] else np.ascontiguousarray(tables[:, :width]))


class PagedDecodeCursor:
    """The paged block manager's cursor (see the module docstring)."""

    __slots__ = ("kv", "rows", "padded_rows", "_state", "_until", "_tables", "_blocks_in_use")  # see __init__

    def __init__(self, kv: BlockManager, rows: np.ndarray, padded_rows: np.ndarray):
        bs, n = kv.block_size, len(rows)
        self.kv, self.rows, self.padded_rows = kv, rows, padded_rows
        positions = kv.num_tokens.take(rows)  # i32[n] position of each row's next token
        state = np.zeros((3, len(padded_rows)), np.int32)  # the next step's positions, slots, context lengths
        state[0, :n] = positions
        state[2, :n] = positions
        state[2, :n] += 1
        # slot = block * bs + position % bs, as block * bs + position - logical * bs in place: on
        # tens of rows each numpy call costs more than its arithmetic. (A row whose next token
        # starts a block reads table entry 0 here and gets its slot when it crosses.)
        logical = positions // bs
        slots = kv.block_tables[rows, logical]
        slots *= bs
        slots += positions
        slots -= logical * bs
        state[1, :n] = slots
        self._state = state
        # Steps before some row's next token starts a block, a lower bound: the step where it is
        # 0 looks for such rows. The row furthest into its block crosses first.
        self._until = 0
        self._blocks_in_use = int(logical.max()) + 1 if n else 1  # the longest row's blocks after its next token
        width = _table_width(kv, self._blocks_in_use)
        self._tables = np.ascontiguousarray(kv.block_tables.take(padded_rows, axis=0)[:, :width])  # i32[S, M]

    def kept(self, keep: np.ndarray | slice, padded_rows: np.ndarray) -> PagedDecodeCursor:
        """The cursor of the batch's rows `keep` (i64[m] batch indices, ascending, or a slice: the
        batch less a preempted group, or less finished sequences), padded to `padded_rows`: the
        same arrays, cut. (Fewer rows cross a boundary no sooner: the steps to the next one hold.)"""
        kept = PagedDecodeCursor.__new__(PagedDecodeCursor)
        kept.kv, kept.rows, kept.padded_rows, kept._until = self.kv, self.rows[keep], padded_rows, self._until
        m, size = len(kept.rows), len(padded_rows)
        kept._state = np.zeros((3, size), np.int32)
        kept._state[:, :m] = self._state[:, keep]
        kept._blocks_in_use = int(kept._state[0, :m].max()) // self.kv.block_size + 1 if m else 1
        width = _table_width(self.kv, kept._blocks_in_use)
        kept._tables = np.zeros((size, width), np.int32)
        width = min(width, self._tables.shape[1])  # wider: the crossing row's block is not open yet
        kept._tables[:m, :width] = self._tables[keep, :width]
        return kept

    def step(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(i32[3, S] positions / slots / context lengths, i32[S, M] block tables) of one more
        token per row, padding rows zero; None (nothing changed) when blocks run out. The
        returned arrays are never written again (the plan may keep them)."""
        kv, n = self.kv, len(self.rows)
        state = self._state  # private until returned
        if self._until == 0:  # some rows' tokens start a block this step
            offsets = state[0, :n] % kv.block_size
            crossing = (offsets == 0).nonzero()[0].tolist()
            if crossing:
                if len(crossing) > kv.num_free_blocks:
                    return None
                self._open_blocks(crossing, state)
            # The row furthest into its block crosses first: after block_size - 1 - offset more steps.
            self._until = kv.block_size - 1 - int(offsets.max())
        else:
            self._until -= 1
        kv.num_tokens.put(self.rows, state[2, :n])
        self._state = state + _increment(n, state.shape[1])
        return state, self._tables

    def _open_blocks(self, crossing: list[int], state: np.ndarray) -> None:
        """Fresh blocks for the rows (batch indices) whose token this step starts a block."""
        kv, bs = self.kv, self.kv.block_size
        positions, slots = state[0], state[1]
        logical = [int(positions[i]) // bs for i in crossing]
        blocks = kv.open_blocks(self.rows[crossing].tolist(), logical)
        for i, block in zip(crossing, blocks):
            slots[i] = block * bs
        self._blocks_in_use = max(self._blocks_in_use, max(logical) + 1)
        width = _table_width(kv, self._blocks_in_use)
        if width > self._tables.shape[1]:  # a row grew past the bucketed width: gather anew
            self._tables = np.ascontiguousarray(kv.block_tables.take(self.padded_rows, axis=0)[:, :width])
        else:
            tables = self._tables = self._tables.copy()  # the previous step's plan holds the old one
            for i, index, block in zip(crossing, logical, blocks):
                tables[i, index] = block
