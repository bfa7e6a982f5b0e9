"""The memory-manager interface the scheduler talks to, whatever the KV layout behind it.

The paged `BlockManager` (vLLM) and the contiguous `ContiguousBlockManager` (Orca, FasterTransformer)
implement it; the scheduler never asks which one it has. A manager owns every block id and the
block-table rows of resident sequences (one `RowStore`, the same class in both), and answers the
scheduler's questions in its own terms: a paged pool takes blocks as tokens come and lets forks
share them; a contiguous one reserves a sequence's whole final length (and a group's future forks)
at admission, so appending never fails. Swapping and prefix caching are the paged pool's: the
contiguous one has neither (`swap` and `prefix_cache` are None). What only one manager or only a
measurement needs stays off the interface: the paged decode cursor's `open_next_blocks`, the
paper's usage split (`jpaged.paper.kv_usage`). Pure Python + numpy: no jax import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Hashable, Protocol

import numpy as np

from jpaged.core.kv.prefix_cache import NO_HIT, PrefixCache, PrefixHit

if TYPE_CHECKING:
    from jpaged.core.kv.row_store import RowStore
    from jpaged.core.kv.swap_space import SwapSpace


# A manager's prefix-cache figures (`KVCacheManager.cache_stats`), as they read without a cache:
# cached device blocks, device evictions, pinned blocks; the host tier's capacity, blocks held, use,
# tokens its promoted blocks held (hits), promotions, offloads and evictions.
NO_CACHE_STATS = {"prefix_cached_blocks": 0, "prefix_cache_evictions": 0, "num_pinned_blocks": 0,
                  "host_cache_blocks": 0, "host_cache_used_blocks": 0, "host_cache_usage": 0.0,
                  "host_cache_hit_tokens": 0, "host_cache_promotions": 0, "host_cache_offloads": 0,
                  "host_cache_evictions": 0}


class DecodeCursor(Protocol):
    """The running batch's decode steps over a fixed set of rows, kept from step to step (see
    jpaged.core.kv.slot_cursor): each step gives every row one more slot."""

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
    rows: RowStore  # the block-table rows of resident sequences (tables, token counts, seq -> row)
    prefix_cache: PrefixCache | None  # the radix tree, when prefix caching is on
    swap: SwapSpace | None  # host memory for preempted groups (None: the manager never swaps)

    @property
    def num_free_blocks(self) -> int:
        """Device blocks a sequence could take now."""

    @property
    def num_usable_blocks(self) -> int:
        """Device blocks that can hold tokens (all but reserved block 0)."""

    @property
    def num_events(self) -> int:
        """Block events so far (admissions, forks, frees, swaps, cache inserts): a count that moves
        whenever a waiting request's answer from `can_admit` might have (the admission pass skips
        retrying a held-back request until it does)."""

    def cache_stats(self) -> dict:
        """The prefix cache's figures, `NO_CACHE_STATS`'s keys (asked only when `prefix_cache` is set)."""

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct device blocks held by pinned prefixes: never free (0 without prefix caching)."""

    def num_shared_pinned(self, hits: PrefixHit) -> int:
        """Pinned blocks a sequence whose cached prefix is `hits` maps as they are (not its own)."""

    def fits(self, num_tokens: int, *, width: int = 1, final_len: int | None = None, extra_blocks: int = 0,
             hits: PrefixHit = NO_HIT) -> bool:
        """The fit rule: whether a group could ever run in this pool, every block free but the
        pinned ones it does not share: its first sequence of `num_tokens` tokens with the cached
        prefix `hits`, growing to `final_len` (None: not known yet), `width` sequences at most,
        `extra_blocks` more for its other sequences' own blocks. False means reject: at the door
        (`request_checks`), at admission (a recomputed group that outgrew it)."""

    def can_admit(self, num_tokens: int, num_scheduled: int, hits: PrefixHit = NO_HIT, *, width: int = 1,
                  final_len: int | None = None, headroom: int | None = None, extra_blocks: int = 0) -> bool:
        """Whether a group that `fits` may start its first sequence now (`num_tokens` long,
        `num_scheduled` of them getting slots this step, `hits` cached), keeping `headroom` blocks
        free (None: the manager's watermark); `extra_blocks` go to its other sequences this step."""

    def admit(self, seq_id: int, hits: PrefixHit = NO_HIT, *, width: int = 1, final_len: int | None = None,
              num_tokens: int | None = None) -> int:
        """Starts a group's first sequence holding its cached prefix; returns its row."""

    def match_prefix(self, token_ids: list[int], cache_salt: Hashable = None,
                     keys: list[tuple[int, ...]] | None = None) -> PrefixHit:
        """The cached prefix of `token_ids` (`prefix_cache.NO_HIT` without a cache)."""

    def cache_blocks(self, seq_id: int, token_ids: list[int], cache_salt: Hashable = None,
                     keys: list[tuple[int, ...]] | None = None) -> None:
        """Offers a resident sequence's written full blocks to the prefix cache (if any)."""

    def append_slots(self, rows: np.ndarray, counts: np.ndarray | None = None, *, may_share: bool = True
                     ) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        """Slots for `counts[i]` (default 1) more tokens of each row, or None (nothing changed) if out
        of blocks; `may_share=False` promises no row shares its last block with a fork."""

    def append_row(self, row: int, count: int) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        """`append_slots` for one row and `count` tokens (a prompt chunk)."""

    def blocks_needed(self, rows: list[int], counts: list[int] | None = None) -> int:
        """Blocks `append_slots(rows, counts)` would take now (its check against `num_free_blocks`)."""

    def decode_cursor(self, rows: list[int]) -> DecodeCursor:
        """A cursor over `rows` (no forked siblings): each `step()` gives every row one more slot
        and returns the step's arrays, or None (nothing changed) when out of blocks; rows join
        (`add(row)`) and leave (`remove(index)`, the last row moving into its place) in place
        (see jpaged.core.kv.slot_cursor)."""

    def fork(self, parent_id: int, child_id: int, num_blocks: int | None = None) -> int:
        """A new sequence of the parent's group holding the parent's first `num_blocks` blocks (default all)."""

    def free(self, seq_id: int) -> None:
        """Drops a sequence's blocks (device or host)."""


def usage(kv: KVCacheManager) -> float:
    """Fraction of the usable device blocks in use (cached blocks nobody references count as free)."""
    return 1.0 - kv.num_free_blocks / kv.num_usable_blocks
