"""The memory-manager interface the scheduler talks to, whatever the KV layout behind it.

The paged `BlockManager` (vLLM) and the contiguous `ContiguousBlockManager` (Orca, FasterTransformer)
implement it; the scheduler never asks which one it has. A manager owns every block id, one
block-table row per resident sequence (`block_tables[row]`, `num_tokens[row]`), and answers the
scheduler's questions in its own terms: a paged pool takes blocks as tokens come and lets forks
share them; a contiguous one reserves a sequence's whole final length (and a group's future forks)
at admission, so appending never fails. Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import enum
from typing import Hashable, Protocol

import numpy as np


class AllocStatus(enum.Enum):
    """Answer of `can_admit`."""

    OK = "ok"  # enough free blocks now (keeping the headroom)
    LATER = "later"  # fits in the pool, not now
    NEVER = "never"  # needs more blocks than the whole pool (or the table width): reject


class DecodeCursor(Protocol):
    """The running batch's decode steps over a fixed set of rows, kept from step to step (see
    jpaged.core.decode_cursor): each step gives every row one more slot."""

    def add(self, row: int) -> None:
        """Appends a row (its next token gets a slot from the next step on)."""

    def remove(self, i: int) -> None:
        """Removes the row at batch index i; the last row takes its place."""

    def blocks_needed(self) -> int:
        """Blocks the next `step` takes."""

    def step(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(i32[3, S] positions / slots / context lengths, i32[S, M] block tables) of one more token
        per row, padding rows zero; None (nothing changed) when blocks run out."""


class KVCacheManager(Protocol):
    """What the scheduler needs from a KV memory manager."""

    block_size: int  # token slots per block
    # Row 0 is reserved: it never holds a sequence (no tokens, a table of zeros), so a step's
    # padding rows gather it (like block 0, which padded writes land in).
    block_tables: np.ndarray  # i32[rows, max_blocks_per_seq] physical block of each logical block
    num_tokens: np.ndarray  # i32[rows] tokens of each row that have a slot
    num_table_blocks: np.ndarray  # i32[rows] logical blocks in use per row
    max_blocks_per_seq: int  # table width: max_model_len in blocks
    watermark_blocks: int  # free blocks kept at admission while other groups run
    num_host_blocks: int  # swap space (0: none)
    prefix_cache: object | None  # the radix tree, when prefix caching is on

    @property
    def num_free_blocks(self) -> int:
        """Device blocks a sequence could take now."""

    @property
    def num_usable_blocks(self) -> int:
        """Device blocks that can hold tokens (all but reserved block 0)."""

    @property
    def num_free_host_blocks(self) -> int:
        """Free swap blocks."""

    def usage(self) -> float:
        """Fraction of usable device blocks in use."""

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks holding `num_tokens` tokens."""

    def has_seq(self, seq_id: int) -> bool:
        """True when `seq_id` holds device blocks."""

    def is_swapped(self, seq_id: int) -> bool:
        """True when `seq_id` holds host blocks."""

    def num_slots(self, seq_id: int) -> int:
        """Tokens of `seq_id` that have a slot in its device row (0 when it holds none): the
        scheduler's count of its computed tokens, this step's scheduled ones included."""

    def row_of(self, seq_id: int) -> int:
        """The block-table row of a resident sequence."""

    def rows_of(self, seq_ids: list[int]) -> np.ndarray:
        """i64[n] block-table rows of resident sequences."""

    def match_prefix(self, token_ids: list[int], cache_salt: Hashable = None,
                     keys: list[tuple[int, ...]] | None = None) -> list[int]:
        """Cached blocks of the longest whole-block prefix of `token_ids` (empty without a cache)."""

    def can_admit(self, num_tokens: int, num_scheduled: int, hits: list[int] = (), *, width: int = 1,
                  final_len: int | None = None, headroom: int | None = None, extra_blocks: int = 0) -> AllocStatus:
        """Whether a group's first sequence (`num_tokens` long, `num_scheduled` of them getting slots
        this step, `hits` cached) may start, the group holding up to `width` sequences of at most
        `final_len` tokens; `extra_blocks` go to its other sequences this step."""

    def admit(self, seq_id: int, hits: list[int] = (), *, width: int = 1, final_len: int | None = None,
              num_tokens: int | None = None) -> int:
        """Starts a group's first sequence holding its cached prefix; returns its row."""

    def append_slots(self, rows: np.ndarray, counts: np.ndarray | None = None, *, may_share: bool = True
                     ) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        """Slots for `counts[i]` (default 1) more tokens of each row, or None (nothing changed) if out
        of blocks; `may_share=False` promises no row shares its last block with a fork."""

    def blocks_needed(self, rows: list[int], counts: list[int] | None = None) -> int:
        """Blocks `append_slots(rows, counts)` would take now (its check against `num_free_blocks`)."""

    def append_row(self, row: int, count: int) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        """`append_slots` for one row and `count` tokens (a prompt chunk)."""

    def open_next_blocks(self, rows: list[int]) -> tuple[list[int], list[int]]:
        """Fresh blocks for rows whose next token starts a block (the cursor checked the free
        blocks): (the blocks, the logical index each takes in its row's table)."""

    def decode_cursor(self, rows: list[int]) -> DecodeCursor:
        """A cursor over `rows` (no forked siblings): each `step()` gives every row one more slot
        and returns the step's arrays, or None (nothing changed) when out of blocks; rows join
        (`add(row)`) and leave (`remove(index)`, the last row moving into its place) in place
        (see jpaged.core.decode_cursor)."""

    def fork(self, parent_id: int, child_id: int, num_blocks: int | None = None) -> int:
        """A new sequence of the parent's group holding the parent's first `num_blocks` blocks (default all)."""

    def free(self, seq_id: int) -> None:
        """Drops a sequence's blocks (device or host)."""

    def cache_blocks(self, seq_id: int, token_ids: list[int], cache_salt: Hashable = None,
                     keys: list[tuple[int, ...]] | None = None) -> None:
        """Offers a resident sequence's written full blocks to the prefix cache (if any)."""

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        """Whether these resident sequences fit in the swap space."""

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Moves them to host memory; returns (device, host) block pairs to copy."""

    def swapped_blocks(self, seq_ids: list[int]) -> int:
        """Device blocks these swapped sequences need to come back."""

    def can_swap_in(self, seq_ids: list[int], extra_blocks: int = 0, headroom: int | None = None) -> bool:
        """Whether they fit on the device now, plus `extra_blocks`, keeping `headroom` free."""

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Brings them back; returns (host, device) block pairs to copy."""

    def usage_breakdown(self, final_lens: dict[int, int], next_request: tuple[int, int] | None = None
                        ) -> tuple[int, int, int, int]:
        """(token_states, reserved, internal, external) slots now (paper Fig. 2)."""
