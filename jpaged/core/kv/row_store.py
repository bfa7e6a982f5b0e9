"""Block-table rows: the one store of which block holds which sequence's tokens, for every KV manager.

Each sequence that holds device blocks has a row of one persistent int32 table `[rows,
max_blocks_per_seq]` mapping its logical blocks to physical ones, and two counters per row: the
tokens that have a slot (`num_tokens`: the scheduler's count of a sequence's computed tokens) and
the table entries in use (`num_table_blocks`). Steps gather these rows into their plans; the
managers (the paged `BlockManager`, the contiguous baselines) decide which blocks go in them.
Row 0 is reserved: it never holds a sequence, so a step's padding rows gather it (a table of
zeros, like block 0 that padded writes land in).

The arrays live in `array.array` buffers with numpy views of the same memory (`int32_cells`):
whole-batch work uses the views, while per-event paths (admit, free, fork, opening a block: a
few rows each) index the buffers with plain integers, several times cheaper than numpy scalar
indexing. Rows are handed out lowest first and the store doubles when they run out (new buffers:
read the arrays through the store, never keep them across events). Pure Python + numpy.
"""

from __future__ import annotations

import array

import numpy as np


def int32_cells(shape: tuple[int, ...]) -> tuple[array.array, np.ndarray]:
    """Zeroed int32 cells: a flat `array.array` (fast scalar access from Python) and a numpy view
    of the same memory with `shape` (vectorized access). Writes through either show in both."""
    cells = array.array("i", bytes(4 * int(np.prod(shape))))
    assert cells.itemsize == 4
    return cells, np.frombuffer(cells, dtype=np.int32).reshape(shape)


class RowStore:
    """Block-table rows of resident sequences (see the module docstring)."""

    def __init__(self, block_size: int, max_blocks_per_seq: int, num_rows: int):
        self.block_size = block_size  # token slots per block
        self.max_blocks_per_seq = max_blocks_per_seq  # table width: max_model_len in blocks
        self._row_of: dict[int, int] = {}  # seq id -> row of a resident sequence
        self._make(num_rows)
        self._free_rows = list(range(num_rows - 1, 0, -1))  # a stack: the lowest row first
        # Sequences that took or gave up a row so far: admissions, forks, frees and swaps all do, and
        # the admission pass retries a held-back request only after one (`KVCacheManager.num_events`).
        self.num_changes = 0

    def _make(self, num_rows: int) -> None:
        """Zeroed tables and counters for `num_rows` rows (buffers and their views)."""
        # [rows, M] physical block of each logical block; flat cells: row r's entry i at r * M + i
        self.table_cells, self.block_tables = int32_cells((num_rows, self.max_blocks_per_seq))
        self.block_cells, self.num_table_blocks = int32_cells((num_rows,))  # [rows] logical blocks in use
        self.token_cells, self.num_tokens = int32_cells((num_rows,))  # [rows] tokens that have a slot

    @property
    def num_rows(self) -> int:
        """Rows the store holds now, reserved row 0 included (it doubles when they run out)."""
        return len(self.token_cells)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks holding `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ queries

    def has_seq(self, seq_id: int) -> bool:
        """True when `seq_id` holds a row (device blocks)."""
        return seq_id in self._row_of

    def num_slots(self, seq_id: int) -> int:
        """Tokens of `seq_id` that have a slot in its row (0 when it holds none): the scheduler's
        count of its computed tokens, this step's scheduled ones included."""
        row = self._row_of.get(seq_id)
        return 0 if row is None else self.token_cells[row]

    def row_of(self, seq_id: int) -> int:
        """The row of a resident sequence (KeyError naming it otherwise)."""
        try:
            return self._row_of[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} holds no device blocks") from None

    def rows_of(self, seq_ids: list[int]) -> np.ndarray:
        """i64[n] rows of resident sequences (KeyError names the first that is not)."""
        row_of = self._row_of
        try:
            return np.array([row_of[s] for s in seq_ids], dtype=np.int64)
        except KeyError as exc:
            raise KeyError(f"sequence {exc.args[0]} holds no device blocks") from None

    def resident_rows(self) -> np.ndarray:
        """i64[n] the rows of every resident sequence."""
        return np.fromiter(self._row_of.values(), dtype=np.int64, count=len(self._row_of))

    def table(self, seq_id: int) -> np.ndarray:
        """A copy of the blocks of a resident sequence, in logical order."""
        row = self.row_of(seq_id)
        return self.block_tables[row, : self.block_cells[row]].copy()

    def blocks_of(self, row: int) -> list[int]:
        """The blocks of a row, in logical order."""
        base = row * self.max_blocks_per_seq
        return self.table_cells[base: base + self.block_cells[row]].tolist()

    # ------------------------------------------------------------------ rows in and out

    def take(self, seq_id: int) -> int:
        """A free row for `seq_id` (zeroed: no blocks, no tokens); returns it."""
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        self.num_changes += 1
        return row

    def pop(self, seq_id: int) -> int:
        """Forgets which row `seq_id` holds and returns it (its contents stay until `clear`); KeyError
        when it holds none."""
        row = self._row_of.pop(seq_id)
        self.num_changes += 1
        return row

    def clear(self, row: int) -> None:
        """Zeroes a row given up by its sequence and makes it free again."""
        n = self.block_cells[row]
        if n:  # (an empty slice assignment would raise: the buffer is exported)
            base = row * self.max_blocks_per_seq
            self.table_cells[base: base + n] = array.array("i", bytes(4 * n))
        self.block_cells[row] = 0
        self.token_cells[row] = 0
        self._free_rows.append(row)

    def _grow(self) -> None:
        """Doubles the rows, keeping the live ones (new buffers: views of the old stay valid)."""
        old = self.num_rows
        tables, row_blocks, row_tokens = self.table_cells, self.block_cells, self.token_cells
        self._make(2 * old)
        self.table_cells[: len(tables)] = tables
        self.block_cells[:old] = row_blocks
        self.token_cells[:old] = row_tokens
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))
