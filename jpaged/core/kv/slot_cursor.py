"""Decode cursors: one slot per sequence per step for the running batch, without per-step gathers.

A steady decode step gives every running sequence one more KV slot and hands the executor each
row's position, slot and context length, plus the block tables. All of that changes by +1 per
step except at a block boundary, and each row reaches its next boundary exactly every
`block_size` steps. `PagedDecodeCursor` keeps the next step's padded arrays, and sorts its rows
into `block_size` classes by the step at which they cross a boundary, so a step is one array add,
plus opening blocks for the class whose turn it is (`PagedPool.open_next_blocks`). `AppendCursor`
is the generic form over any `KVCacheManager.append_slots` (the contiguous baselines use it).

Both are persistent: rows join (`add`) and leave (`remove`, the last row moving into the hole,
as vLLM v1's input batch condenses) in place, so an admission, a finish or a preemption edits a
few entries instead of rebuilding the arrays. A cursor is valid while its rows get slots only
through it; the batch drops it when they get slots another way (chunks in the same step, forks).
It never writes into a shared block: the batch has no forked sequences, and prefix-cache sharing
covers whole blocks only. Pure numpy: no jax import.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Protocol

import numpy as np

from jpaged.core.padding import bucket, table_width

if TYPE_CHECKING:
    from jpaged.core.kv.kv_manager import KVCacheManager
    from jpaged.core.kv.row_store import RowStore


class PagedPool(Protocol):
    """What `PagedDecodeCursor` needs of the paged block manager: its rows and free blocks, and
    fresh blocks for the rows whose next token starts one."""

    block_size: int
    rows: RowStore

    @property
    def num_free_blocks(self) -> int:
        """Device blocks a sequence could take now."""

    def open_next_blocks(self, rows: list[int]) -> tuple[list[int], list[int]]:
        """A fresh block after the last of each of `rows` (room was checked): (the blocks, the
        logical index each takes in its row's table)."""


@functools.lru_cache(maxsize=1024)
def _increment(n: int, size: int) -> np.ndarray:
    """i32[3, size]: +1 to the position, slot and context length of the n real rows (read-only)."""
    inc = np.zeros((3, size), np.int32)
    inc[:, :n] = 1
    inc.flags.writeable = False
    return inc


class AppendCursor:
    """The generic cursor: `append_slots` each step, then the step's arrays gathered from the
    manager's tables (any `KVCacheManager`)."""

    def __init__(self, kv: KVCacheManager, rows: list[int]):
        self.kv = kv
        self._rows = np.zeros(bucket(len(rows)), np.int64)  # i64[C] rows, then row 0 (C a bucket size)
        self._rows[: len(rows)] = rows
        self._n = len(rows)

    def add(self, row: int) -> None:
        """Appends a row (its next token gets a slot from the next step on)."""
        if self._n == len(self._rows):
            self._rows = np.concatenate([self._rows, np.zeros(bucket(2 * self._n) - self._n, np.int64)])
        self._rows[self._n] = row
        self._n += 1

    def remove(self, i: int) -> None:
        """Removes row i; the last row takes its place."""
        last = self._n - 1
        self._rows[i] = self._rows[last]
        self._rows[last] = 0
        self._n = last

    def blocks_needed(self) -> int:
        """Blocks the next `step` takes."""
        return self.kv.blocks_needed(self._rows[: self._n].tolist())

    def step(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(i32[3, S] positions / slots / context lengths, i32[S, M] block tables) of one more
        token per row, padding rows zero; None (nothing changed) when blocks run out."""
        kv, n = self.kv, self._n
        appended = kv.append_slots(self._rows[:n], may_share=False)
        if appended is None:
            return None
        store, padded_rows = kv.rows, self._rows[: bucket(n)]
        state = np.zeros((3, len(padded_rows)), np.int32)
        state[2] = store.num_tokens.take(padded_rows)
        np.subtract(state[2, :n], 1, out=state[0, :n])
        state[1, :n] = appended[0]
        longest = int(state[2, :n].max()) if n else 1
        tables = store.block_tables.take(padded_rows, axis=0)
        width = table_width(-(-longest // kv.block_size), store.max_blocks_per_seq)
        return state, (tables if width == tables.shape[1] else np.ascontiguousarray(tables[:, :width]))


class PagedDecodeCursor:
    """The paged block manager's cursor (see the module docstring).

    Its buffers are the step's padded arrays, S = bucket(n) rows (resized when n crosses a
    bucket bound); rows [n, S) are zero. `_state` is private until a step hands it out (the next
    step's is a new array); `_tables` is shared with the last plan once handed out
    (`_tables_out`) and copied before it is written again.
    """

    __slots__ = ("kv", "_row_list", "_rows", "_state", "_increment", "_tables", "_tables_out", "_blocks_in_use",
                 "_due", "_t")

    def __init__(self, kv: PagedPool, rows: list[int]):
        bs, n, store = kv.block_size, len(rows), kv.rows
        self.kv = kv
        self._row_list = list(rows)  # [n] the rows, in batch order (a crossing row's index: .index)
        self._rows = np.zeros(bucket(n), np.int64)  # i64[S] the rows, then row 0
        self._rows[:n] = rows
        positions = store.num_tokens.take(self._rows[:n])  # i32[n] position of each row's next token
        self._state = state = np.zeros((3, len(self._rows)), np.int32)  # the next step's positions, slots, context lengths
        self._increment = _increment(n, len(self._rows))  # i32[3, S] what a step adds to it
        state[0, :n] = positions
        state[2, :n] = positions
        state[2, :n] += 1
        # slot = block * bs + position % bs. (A row whose next token starts a block reads table
        # entry 0 here and gets its slot when it crosses.)
        logical = positions // bs
        state[1, :n] = store.block_tables[self._rows[:n], logical] * bs + positions % bs
        self._blocks_in_use = int(logical.max()) + 1 if n else 1  # the longest row's blocks after its next token
        width = table_width(self._blocks_in_use, store.max_blocks_per_seq)
        self._tables = np.ascontiguousarray(store.block_tables.take(self._rows, axis=0)[:, :width])  # i32[S, M]
        self._tables_out = False
        # A row whose next position is p at step t starts a block at every step t' with
        # t' = t - p (mod bs): `_due[k]` holds the rows whose turn comes at the steps t' = k (mod bs).
        self._t = 0  # steps taken
        self._due: list[list[int]] = [[] for _ in range(bs)]
        for row, p in zip(rows, positions.tolist()):
            self._due[-p % bs].append(row)

    def add(self, row: int) -> None:
        """Appends a row (no forked siblings; its next token gets a slot from the next step on)."""
        kv, bs, n = self.kv, self.kv.block_size, len(self._row_list)
        store = kv.rows
        if n == len(self._rows):
            self._resize(bucket(n + 1))
        p = int(store.num_tokens[row])
        logical, offset = divmod(p, bs)
        self._row_list.append(row)
        self._rows[n] = row
        state = self._state
        state[0, n] = p
        state[1, n] = int(store.block_tables[row, logical]) * bs + offset if offset else 0
        state[2, n] = p + 1
        self._due[(self._t - p) % bs].append(row)
        self._increment = _increment(n + 1, len(self._rows))
        width = self._tables.shape[1]
        if logical + 1 > self._blocks_in_use:  # the longest row now: the tables may widen
            self._blocks_in_use = logical + 1
            if table_width(logical + 1, store.max_blocks_per_seq) > width:
                self._regather(table_width(logical + 1, store.max_blocks_per_seq))
                return
        self._writable_tables()[n] = store.block_tables[row, :width]

    def remove(self, i: int) -> None:
        """Removes the row at batch index i; the last row takes its place."""
        kv, bs = self.kv, self.kv.block_size
        last = len(self._row_list) - 1
        state, tables = self._state, self._writable_tables()
        p = int(state[0, i])
        self._due[(self._t - p) % bs].remove(self._row_list[i])
        if i != last:
            self._row_list[i] = self._row_list[last]
            self._rows[i] = self._rows[last]
            state[:, i] = state[:, last]
            tables[i] = tables[last]
        self._row_list.pop()
        self._rows[last] = 0
        state[:, last] = 0
        tables[last] = 0
        self._increment = _increment(last, len(self._rows))
        if p // bs + 1 >= self._blocks_in_use:  # it may have been the longest: the width is the rest's
            # (Their next tokens' blocks: as the next step will see them, crossings included.)
            self._blocks_in_use = int(state[0, :last].max()) // bs + 1 if last else 1
            width = table_width(self._blocks_in_use, kv.rows.max_blocks_per_seq)
            if width < tables.shape[1]:
                self._tables = np.ascontiguousarray(tables[:, :width])
            elif width > tables.shape[1]:
                self._regather(width)
        if bucket(last) < len(self._rows):
            self._resize(bucket(last))

    def blocks_needed(self) -> int:
        """Blocks the next `step` takes: one per row whose token starts a block."""
        return len(self._due[self._t % self.kv.block_size])

    def step(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(i32[3, S] positions / slots / context lengths, i32[S, M] block tables) of one more
        token per row, padding rows zero; None (nothing changed) when blocks run out. The
        returned arrays are never written again (the plan may keep them)."""
        kv = self.kv
        state = self._state  # private until returned
        crossing = self._due[self._t % kv.block_size]
        if crossing:  # these rows' tokens start a block this step
            if len(crossing) > kv.num_free_blocks:
                return None
            self._open_blocks(crossing, state)
        # (Padding rows write 0 into reserved row 0's count, which stays 0.)
        kv.rows.num_tokens.put(self._rows, state[2])
        self._state = state + self._increment
        self._t += 1
        self._tables_out = True
        return state, self._tables

    def _open_blocks(self, crossing: list[int], state: np.ndarray) -> None:
        """Fresh blocks for the rows whose token this step starts a block."""
        kv, bs, row_list = self.kv, self.kv.block_size, self._row_list
        if len(crossing) == 1:
            index = [row_list.index(crossing[0])]
        else:  # in batch order, as `append_slots` would take them (the same blocks for the same steps)
            index = sorted(map(row_list.index, crossing))
            crossing = [row_list[i] for i in index]
        blocks, logical = kv.open_next_blocks(crossing)
        slots = state[1]
        for i, block in zip(index, blocks):
            slots[i] = block * bs
        widest = max(logical) + 1
        if widest > self._blocks_in_use:
            self._blocks_in_use = widest
            width = table_width(widest, kv.rows.max_blocks_per_seq)
            if width > self._tables.shape[1]:  # a row grew past the bucketed width: gather anew
                self._regather(width)
                return
        tables = self._writable_tables()
        for i, column, block in zip(index, logical, blocks):
            tables[i, column] = block

    def _writable_tables(self) -> np.ndarray:
        """`_tables`, copied first if the last step handed it out."""
        if self._tables_out:
            self._tables = self._tables.copy()
            self._tables_out = False
        return self._tables

    def _regather(self, width: int) -> None:
        """`_tables` anew from the manager's, `width` columns."""
        self._tables = np.ascontiguousarray(self.kv.rows.block_tables.take(self._rows, axis=0)[:, :width])
        self._tables_out = False

    def _resize(self, size: int) -> None:
        """Buffers of `size` rows (the padded size changed), the first rows kept."""
        keep = min(size, len(self._rows))
        rows, state, tables = np.zeros(size, np.int64), np.zeros((3, size), np.int32), \
            np.zeros((size, self._tables.shape[1]), np.int32)
        rows[:keep], state[:, :keep], tables[:keep] = self._rows[:keep], self._state[:, :keep], self._tables[:keep]
        self._rows, self._state, self._tables, self._tables_out = rows, state, tables, False
        self._increment = _increment(len(self._row_list), size)
