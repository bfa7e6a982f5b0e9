"""The paged KV cache managed like virtual memory (paper §4.2–4.4).

Physical blocks of `block_size` token slots live in a device pool (and, for preempted groups and
the prefix cache's host tier, a host pool: `jpaged.core.kv.swap_space`, `jpaged.core.kv.host_tier`). Each sequence has a block-table row (`jpaged.core.kv.row_store`)
mapping its logical blocks to physical ones. A reference count per physical block lets sequences
of a group share blocks (parallel sampling, beam search, a recomputed group's common history); a
write into a shared block is preceded by copy-on-write. Full blocks may stay in the radix prefix
cache after their last reference (`jpaged.core.kv.prefix_cache`): unreferenced cached blocks count
as free and are evicted on demand (to the host tier, when there is one). A pinned prefix's
blocks hold a reference of the pin and never go. Block 0 is reserved: padding entries point at it, so padded
writes are harmless.

Hot paths are vectorized over sequences (`append_slots`); the free list is a Python list used as
a stack (O(1) pop and push). The reference counts, like the rows, live in `array.array` buffers
with numpy views of the same memory (`row_store.int32_cells`): whole-batch operations use the
views, the per-event paths (admit, free, fork, opening a block) the buffers with plain integers.
Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import array
from typing import Hashable

import numpy as np

from jpaged.core.kv.slot_cursor import PagedDecodeCursor
from jpaged.core.kv.eviction import make_policy
from jpaged.core.kv.host_tier import HostTier
from jpaged.core.kv.kv_manager import NO_CACHE_STATS
from jpaged.core.kv.prefix_cache import NO_HIT, PrefixCache, PrefixHit, block_keys
from jpaged.core.kv.row_store import RowStore, int32_cells
from jpaged.core.kv.swap_space import SwapSpace


class BlockManager:
    """The device block pool, its reference counts and the rows of live sequences, with a swap
    space and an optional prefix cache (implements `kv_manager.KVCacheManager`)."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int, max_model_len: int,
                 watermark: float = 0.01, max_seqs: int = 256, enable_prefix_caching: bool = False,
                 num_host_cache_blocks: int = 0, eviction_policy: str = "lru"):
        """`num_host_blocks` host blocks of swap space (0: no swap), and `num_host_cache_blocks`
        more that the prefix cache's host tier may hold (one pool: `jpaged.core.kv.host_tier`;
        swap-outs may take the tier's blocks too, but only with swap space); `eviction_policy`
        orders both tiers' evictions (`jpaged.core.kv.eviction.POLICIES`)."""
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_cache_blocks and not enable_prefix_caching:
            raise ValueError(f"num_host_cache_blocks: a host tier ({num_host_cache_blocks} blocks) needs "
                             "enable_prefix_caching")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.watermark_blocks = int(watermark * (num_blocks - 1))  # free blocks kept at admission by default
        self._refs, self.refcount = int32_cells((num_blocks,))  # [N] references from block tables (and pins)
        self._block_offsets = np.arange(block_size, dtype=np.int32)  # [block_size] slot offsets in a block
        # A stack: pop() hands out the lowest id first, which keeps pictures of the pool readable.
        self._free = list(range(num_blocks - 1, 0, -1))
        self.rows = RowStore(block_size, -(-max_model_len // block_size), max(1, max_seqs) + 1)
        # Row -> how far its blocks are in the prefix cache as its own (PrefixCache.insert's path).
        self._cache_paths: dict[int, tuple] = {}
        self.swap = SwapSpace(self, num_host_blocks + num_host_cache_blocks, swaps=num_host_blocks > 0)
        # Cached blocks without references stay off the free list until evicted on demand.
        self.prefix_cache = None
        self.host_tier = None  # the prefix cache's second tier, in host memory
        if enable_prefix_caching:
            self.host_tier = (HostTier(self.swap, num_host_cache_blocks,
                                       make_policy(eviction_policy, num_host_cache_blocks))
                              if num_host_cache_blocks else None)
            self.prefix_cache = PrefixCache(block_size, make_policy(eviction_policy, num_blocks - 1), self.host_tier)
            self.swap.tier = self.host_tier
        # Unreferenced cached blocks: as good as free (evicted on demand).
        self._reclaimable = self.prefix_cache.evictable if self.prefix_cache is not None else ()
        # (salt, prefix tokens) -> the blocks its pin holds (`pin_prefix`); pins of prefixes that
        # start alike hold the same blocks, each pin a reference of its own.
        self.pinned: dict[tuple[Hashable, tuple[int, ...]], list[int]] = {}
        self._pinned_blocks: set[int] = set()  # the distinct blocks of `pinned`
        self._num_cache_events = 0  # prefix-cache inserts, pins and host frees (`num_events`)

    # ------------------------------------------------------------------ queries

    @property
    def num_pinned_blocks(self) -> int:
        """Distinct device blocks the pins hold (never free again)."""
        return len(self._pinned_blocks)

    @property
    def num_free_blocks(self) -> int:
        """Device blocks available now: free ones plus unreferenced cached ones (block 0 excluded)."""
        return len(self._free) + len(self._reclaimable)

    @property
    def num_usable_blocks(self) -> int:
        """Device blocks that can hold tokens (all but block 0)."""
        return self.num_blocks - 1

    @property
    def num_events(self) -> int:
        """Block events so far: sequences taking or giving up rows (admissions, forks, frees, swaps),
        prefix-cache inserts and frees of swapped-out sequences."""
        return self.rows.num_changes + self._num_cache_events

    def cache_stats(self) -> dict:
        """The prefix cache's figures (`kv_manager.NO_CACHE_STATS`'s keys): its device blocks,
        evictions and pins, and its host tier's size, use and traffic."""
        cache, tier = self.prefix_cache, self.host_tier
        stats = {**NO_CACHE_STATS, "prefix_cached_blocks": cache.num_cached_blocks,
                 "prefix_cache_evictions": cache.num_evictions, "num_pinned_blocks": self.num_pinned_blocks}
        if tier is not None:
            stats.update(host_cache_blocks=tier.capacity, host_cache_used_blocks=tier.num_blocks,
                         host_cache_usage=tier.num_blocks / tier.capacity,
                         host_cache_hit_tokens=tier.num_promotions * self.block_size,
                         host_cache_promotions=tier.num_promotions, host_cache_offloads=tier.num_offloads,
                         host_cache_evictions=tier.num_evictions)
        return stats

    # ------------------------------------------------------------------ admission

    def match_prefix(self, token_ids: list[int], cache_salt: Hashable = None,
                     keys: list[tuple[int, ...]] | None = None) -> PrefixHit:
        """The cached blocks holding the longest prefix of `token_ids` (never all of it): whole
        blocks on the device, then in the host tier, or a pinned prefix ending inside a block.

        At least the last token is never a hit, so a prefill always has a token to sample from.
        `keys` (`prefix_cache.block_keys` of the tokens) saves recomputing them at every retry.
        NO_HIT without prefix caching.
        """
        if self.prefix_cache is None:
            return NO_HIT
        keys = block_keys(token_ids, self.block_size, keys)
        return self.prefix_cache.match(keys, cache_salt, (len(token_ids) - 1) // self.block_size, token_ids)

    def fits(self, num_tokens: int, *, width: int = 1, final_len: int | None = None, extra_blocks: int = 0,
             hits: PrefixHit = NO_HIT) -> bool:
        """Whether a group could ever hold its blocks here (every block free but the pinned
        prefixes'): its first sequence's `num_tokens` tokens within the block table, and with
        `extra_blocks` more (its other sequences' own blocks) within the pool. The full pinned
        blocks of its cached prefix `hits` (`match_prefix`) are shared, not its own: they take
        nothing more from the pool. `width` and `final_len` do not matter: paged blocks are taken
        as tokens come and forks share them (a group that outgrows the pool later is the
        scheduler's to end)."""
        need = -(-num_tokens // self.block_size)
        return (need <= self.rows.max_blocks_per_seq
                and need - self.num_shared_pinned(hits) + extra_blocks <= self.num_blocks - 1 - self.num_pinned_blocks)

    def num_shared_pinned(self, hits: PrefixHit) -> int:
        """Pinned blocks a sequence with the cached prefix `hits` maps as they are: its full
        device blocks that a pin holds (a pinned partial block is copied when written)."""
        pinned = self._pinned_blocks
        if not pinned or not hits.blocks:
            return 0
        return sum(1 for b in hits.blocks[: len(hits.blocks) - hits.partial] if b in pinned)

    def can_admit(self, num_tokens: int, num_scheduled: int, hits: PrefixHit = NO_HIT, *, width: int = 1,
                  final_len: int | None = None, headroom: int | None = None, extra_blocks: int = 0) -> bool:
        """Whether a sequence of `num_tokens` tokens that `fits` may start now, its first
        `num_scheduled` getting slots.

        `hits` is its cached prefix (`match_prefix`): its device blocks need no new block (but a
        pinned partial block is copied when written), its host-tier blocks need one each.
        `extra_blocks` are blocks other sequences of its group take in the same step. `headroom`
        free blocks must stay free after it (None: the watermark). `width` and `final_len` are
        unused here (see `fits`); contiguous managers take the same arguments and reserve by them.
        """
        blocks = hits.blocks
        need = -(-num_scheduled // self.block_size) - len(blocks) + hits.partial + extra_blocks
        available = len(self._free) + len(self._reclaimable)
        if blocks:  # a hit needs no new block, but an unreferenced cached block stops being reclaimable
            refs = self._refs
            available -= sum(1 for b in blocks if refs[b] == 0)
        headroom = self.watermark_blocks if headroom is None else headroom
        return available - need >= headroom

    def admit(self, seq_id: int, hits: PrefixHit = NO_HIT, *, width: int = 1, final_len: int | None = None,
              num_tokens: int | None = None) -> int:
        """Gives a new sequence a block-table row holding its cached prefix `hits`; returns the row.

        Its host-tier blocks are promoted: fresh device blocks, and the copies queued in the host
        tier for this step. Its other tokens get slots from `append_slots`. (`width`,
        `final_len`, `num_tokens`: see `can_admit`.)
        """
        if self.rows.has_seq(seq_id) or self.swap.holds(seq_id):
            raise ValueError(f"sequence {seq_id} already holds blocks")
        rows = self.rows
        row = rows.take(seq_id)
        blocks, host_blocks = hits.blocks, hits.host_blocks
        if blocks or host_blocks:
            refs, tables, base = self._refs, rows.table_cells, row * rows.max_blocks_per_seq
            for i, block in enumerate(blocks):  # (a prefix path: distinct blocks)
                refs[block] += 1
                tables[base + i] = block
            self.prefix_cache.touch(blocks)  # referenced now: no longer evictable
            if host_blocks:
                cache = self.prefix_cache
                nodes = cache.host.detach(host_blocks)  # out of the host tier first: nothing evicts them now
                promoted = self.take_blocks(len(nodes))  # (may evict other device blocks to the host tier)
                cache.promote(nodes, promoted)
                cache.host.promoted(host_blocks, promoted)
                for i, block in enumerate(promoted, base + len(blocks)):
                    refs[block] = 1
                    tables[i] = block
        rows.block_cells[row] = len(blocks) + len(host_blocks)
        rows.token_cells[row] = hits.num_tokens
        return row

    def pin_cached(self, token_ids: list[int], cache_salt: Hashable = None) -> list[int] | None:
        """Pins a prefix the cache holds: every block of it full and cached on the device (or it
        is pinned already). Returns the pinned blocks, or None (nothing changes) when some of it
        must be computed first (`pin_prefix`)."""
        if self.prefix_cache is None:
            raise ValueError("enable_prefix_caching: pinning a prefix needs the prefix cache")
        key = (cache_salt, tuple(token_ids))
        if key in self.pinned:
            return self.pinned[key]
        full, rest = divmod(len(token_ids), self.block_size)
        nodes = self.prefix_cache.path(block_keys(token_ids, self.block_size), cache_salt)
        if rest or len(nodes) < full or any(n.on_host for n in nodes):
            return None
        return self._hold_pin(key, [n.block for n in nodes])

    def pin_prefix(self, seq_id: int, token_ids: list[int], cache_salt: Hashable = None) -> list[int]:
        """Pins the first `len(token_ids)` tokens (`token_ids`) of resident sequence `seq_id`,
        computed: its full blocks are the prefix cache's (the tree's own device copies where it
        has them, else the sequence's blocks join the tree: `PrefixCache.adopt`), and a partial
        last block, the sequence's, is kept for prompts that continue the prefix
        (`PrefixCache.pin_tail`). The blocks hold a reference of the pin from now on, so they are
        never evicted. Returns the pinned blocks; a prefix pinned already keeps its first blocks
        (nothing changes)."""
        if self.prefix_cache is None:
            raise ValueError("enable_prefix_caching: pinning a prefix needs the prefix cache")
        bs, rows = self.block_size, self.rows
        key = (cache_salt, tuple(token_ids))
        if key in self.pinned:
            return self.pinned[key]
        if rows.num_slots(seq_id) < len(token_ids):
            raise ValueError(f"pin_prefix: sequence {seq_id} holds {rows.num_slots(seq_id)} tokens, "
                             f"fewer than the {len(token_ids)} to pin")
        full = len(token_ids) // bs
        own = rows.blocks_of(rows.row_of(seq_id))[: -(-len(token_ids) // bs)]
        keys = block_keys(token_ids, bs)
        blocks = self.prefix_cache.adopt(keys, cache_salt, own[:full]) + own[full:]
        if full < len(blocks):
            self.prefix_cache.pin_tail(keys, cache_salt, tuple(token_ids[full * bs:]), blocks[-1])
        return self._hold_pin(key, blocks)

    def _hold_pin(self, key: tuple[Hashable, tuple[int, ...]], blocks: list[int]) -> list[int]:
        """Gives the pin `key` a reference on each of `blocks` (distinct device blocks)."""
        refs = self._refs
        unreferenced = [b for b in blocks if refs[b] == 0]
        if unreferenced:  # cached blocks nobody referenced: no longer evictable
            self.prefix_cache.touch(unreferenced)
        for block in blocks:
            refs[block] += 1
        self._pinned_blocks.update(blocks)
        self.pinned[key] = blocks
        self._num_cache_events += 1  # the pool's free blocks and the fit rule changed
        return blocks

    def cache_blocks(self, seq_id: int, token_ids: list[int], cache_salt: Hashable = None,
                     keys: list[tuple[int, ...]] | None = None) -> None:
        """Offers a resident sequence's full blocks (those with slots: written this step or before) to the cache."""
        if self.prefix_cache is None:
            return
        self._num_cache_events += 1
        rows = self.rows
        row = rows.row_of(seq_id)
        num_full = min(rows.token_cells[row], len(token_ids)) // self.block_size
        resume = self._cache_paths.get(row)
        start = 0 if resume is None else resume[1]
        if start >= num_full:
            return  # every full block is in the tree already (or there is none)
        keys = block_keys(token_ids, self.block_size, keys)
        base = row * rows.max_blocks_per_seq
        path = self.prefix_cache.insert(keys[start:num_full], rows.table_cells[base + start: base + num_full],
                                        cache_salt, resume)
        if path is not None:
            self._cache_paths[row] = path

    def free(self, seq_id: int) -> None:
        """Drops a sequence's references (device or host); blocks whose count reaches 0 become free."""
        try:
            row = self.rows.pop(seq_id)
        except KeyError:
            if not self.swap.holds(seq_id):
                raise KeyError(f"cannot free sequence {seq_id}: it holds no blocks (unknown or already freed)") from None
            self.swap.free(seq_id)
            self._num_cache_events += 1
            return
        self.release_blocks(self.rows.blocks_of(row))
        self.clear_row(row)

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Keeps the slots of the first `num_tokens` tokens of a resident sequence and gives back the
        rest: a verify step's rejected drafts (jpaged.core.sched.speculation). Blocks past the kept
        tokens were opened by that step for this sequence alone, so they go free (their
        rejected tokens never reach the prefix cache, which takes full blocks of verified tokens
        only: `cache_blocks` reads the trimmed count); the kept ones stay."""
        rows = self.rows
        row = rows.row_of(seq_id)
        have = rows.token_cells[row]
        if not 0 <= num_tokens <= have:
            raise ValueError(f"trim: sequence {seq_id} holds {have} slots, cannot keep {num_tokens}")
        keep, held = rows.blocks_for(num_tokens), rows.block_cells[row]
        if keep < held:
            base = row * rows.max_blocks_per_seq
            self.release_blocks(rows.table_cells[base + keep: base + held].tolist())
            rows.table_cells[base + keep: base + held] = array.array("i", bytes(4 * (held - keep)))
            rows.block_cells[row] = keep
        rows.token_cells[row] = num_tokens

    def fork(self, parent_id: int, child_id: int, num_blocks: int | None = None) -> int:
        """Gives `child_id` the parent's first `num_blocks` blocks (default all), shared (count + 1).

        A partial fork (a recomputed group's sequences sharing their common history) shares only
        full blocks: the child holds `num_blocks * block_size` tokens. Returns the child's row.
        """
        if self.rows.has_seq(child_id) or self.swap.holds(child_id):
            raise ValueError(f"cannot fork onto sequence {child_id}: it already holds blocks")
        rows = self.rows
        parent_row = rows.row_of(parent_id)
        if num_blocks is not None and not 0 <= num_blocks * self.block_size <= rows.num_tokens[parent_row]:
            raise ValueError(f"cannot fork {num_blocks} blocks of sequence {parent_id}: it holds "
                             f"{rows.num_tokens[parent_row] // self.block_size} full blocks")
        row = rows.take(child_id)
        n = rows.block_cells[parent_row] if num_blocks is None else num_blocks
        blocks = rows.blocks_of(parent_row)[:n]
        rows.block_tables[row, :n] = blocks
        refs = self._refs
        for block in blocks:
            refs[block] += 1
        rows.block_cells[row] = n
        rows.token_cells[row] = rows.token_cells[parent_row] if num_blocks is None else n * self.block_size
        return row

    # ------------------------------------------------------------------ append (every step)

    def append_slots(self, rows: np.ndarray, counts: np.ndarray | None = None, *, may_share: bool = True
                     ) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        """Gives row `rows[i]` slots for `counts[i]` more tokens (default one each), or returns None
        (changing nothing) if blocks run out.

        New blocks are taken only past a row's last full block; a shared last block about to be
        written is copied first (copy-on-write). Returns the slots i32[sum(counts)] (row after
        row, positions in order) and the (src, dst) copy pairs. The one-token case runs every
        decode step for every sequence: one pass of vectorized numpy, with Python loops only
        over the few rows that open a block or copy one. `may_share=False` (no row has forked
        siblings) skips the copy-on-write check: prefix-cache sharing covers full blocks only.
        """
        if counts is None:
            return self._append_one(rows, may_share)
        if len(rows) == 1:  # a prompt chunk at admission: plain integers beat a dozen array ops
            return self.append_row(int(rows[0]), int(counts[0]))
        bs, store = self.block_size, self.rows
        pos = store.num_tokens[rows]  # [n] first new position of each row
        end = pos + counts
        have = store.num_table_blocks[rows]
        new_blocks = (end + bs - 1) // bs - have  # [n] blocks to open
        if (end > store.max_blocks_per_seq * bs).any():
            raise ValueError("append_slots: a row would outgrow its block table (max_model_len)")
        last = store.block_tables[rows, np.maximum(have - 1, 0)]  # [n] current last block
        cow = (pos % bs != 0) & (self.refcount[last] > 1)  # the first new token lands in a shared block
        if int(new_blocks.sum()) + int(cow.sum()) > self.num_free_blocks:
            return None
        copy_pairs: list[tuple[int, int]] = []
        for i in cow.nonzero()[0].tolist():
            src, row = int(last[i]), int(rows[i])
            if self.refcount[src] > 1:  # re-checked: an earlier row may have copied it already
                copy_pairs.append((src, self._copy_on_write(row, int(have[i]) - 1, src)))
        for i in new_blocks.nonzero()[0].tolist():
            self._open_blocks(int(rows[i]), int(have[i]), int(new_blocks[i]))
        store.num_tokens[rows] = end
        # Position of every new token: row i owns [pos[i], end[i]).
        token_rows = np.repeat(rows, counts)
        starts = np.cumsum(counts) - counts
        positions = np.arange(int(counts.sum())) - np.repeat(starts - pos, counts)
        slots = store.block_tables[token_rows, positions // bs] * bs + positions % bs
        return slots.astype(np.int32, copy=False), copy_pairs

    def append_row(self, row: int, count: int) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        """`append_slots` for one row and `count` tokens (the same rules): a prompt chunk at
        admission, with plain integers (a dozen array operations cost more on one row)."""
        bs, store = self.block_size, self.rows
        tables, base = store.table_cells, row * store.max_blocks_per_seq
        pos, have = store.token_cells[row], store.block_cells[row]
        end = pos + count
        if end > store.max_blocks_per_seq * bs:
            raise ValueError("append_slots: a row would outgrow its block table (max_model_len)")
        new_blocks = -(-end // bs) - have
        src = tables[base + have - 1] if have else 0
        cow = pos % bs != 0 and self._refs[src] > 1  # the first new token lands in a shared block
        if new_blocks + cow > self.num_free_blocks:
            return None
        copy_pairs = [(src, self._copy_on_write(row, have - 1, src))] if cow else []
        if new_blocks:
            self._open_blocks(row, have, new_blocks)
        store.token_cells[row] = end
        first, offset = divmod(pos, bs)
        if end <= (first + 1) * bs:  # all in one block: a run of slots
            start = tables[base + first] * bs + offset
            return np.arange(start, start + count, dtype=np.int32), copy_pairs
        # The slots of positions [pos, end): the rows' blocks [pos // bs, ceil(end / bs)) laid out
        # slot by slot, less the first block's offset (one slice and one broadcast, no gather).
        blocks = store.block_tables[row, first: -(-end // bs)]
        slots = (blocks[:, None] * bs + self._block_offsets).ravel()
        return slots[offset: offset + count], copy_pairs

    def _open_blocks(self, row: int, first: int, count: int) -> None:
        """Appends `count` fresh blocks to `row`'s table from logical index `first` (room was checked)."""
        blocks = self.take_blocks(count)
        store = self.rows
        tables, refs, base = store.table_cells, self._refs, row * store.max_blocks_per_seq + first
        for i, block in enumerate(blocks):
            tables[base + i] = block
            refs[block] = 1
        store.block_cells[row] = first + count

    def blocks_needed(self, rows: list[int], counts: list[int] | None = None) -> int:
        """Blocks `append_slots(rows, counts)` would take now: new ones past each row's last full
        block, plus a copy of a shared last block about to be written (counted per row)."""
        store, bs, refs = self.rows, self.block_size, self._refs
        width, tables, row_tokens, row_blocks = store.max_blocks_per_seq, store.table_cells, store.token_cells, \
            store.block_cells
        total = 0
        for i, row in enumerate(rows):
            pos, have = row_tokens[row], row_blocks[row]
            total += -(-(pos + (1 if counts is None else counts[i])) // bs) - have
            if pos % bs and refs[tables[row * width + have - 1]] > 1:
                total += 1
        return total

    def _append_one(self, rows: np.ndarray, may_share: bool) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        # Every decode step, for every sequence: a handful of whole-batch numpy operations, with a
        # Python loop only over the rows that open a block (or copy a shared one).
        bs, store = self.block_size, self.rows
        pos = store.num_tokens[rows]  # [n] position of each row's new token
        logical, offset = np.divmod(pos, bs)  # [n] the block it lands in, and where in it
        # Table entries past a row's blocks are 0 and refcount[0] is 0, so a row that opens a new
        # block never looks shared. An index past the table width raises IndexError: the engine
        # finishes every sequence at max_model_len, so that is a caller bug.
        last = store.block_tables[rows, logical]  # [n] physical block each row writes into
        copy_pairs: list[tuple[int, int]] = []
        if may_share:
            needs = (offset == 0) | (self.refcount[last] > 1)
            needs_any = needs.any()
        else:  # only rows at a block boundary need a block (count_nonzero is the cheapest test)
            needs_any = np.count_nonzero(offset) < len(offset)
            needs = offset == 0 if needs_any else None
        if needs_any:
            needs_block = needs.nonzero()[0]
            if len(needs_block) > self.num_free_blocks:
                return None
            if not may_share:  # every such row opens a block: all at once
                last[needs_block] = self.open_next_blocks(rows[needs_block].tolist())[0]
            else:  # rows that open a block or write into a shared one, row by row
                for i in needs_block.tolist():
                    row, idx = int(rows[i]), int(logical[i])
                    src = int(last[i])
                    if src == 0:  # the row's last block is full: open a new one
                        block = self.take_block()
                        store.table_cells[row * store.max_blocks_per_seq + idx] = block
                        self._refs[block] = 1
                        store.block_cells[row] = idx + 1
                    elif self._refs[src] > 1:  # shared: copy-on-write (re-checked: an earlier row may have copied)
                        block = self._copy_on_write(row, idx, src)
                        copy_pairs.append((src, block))
                    else:
                        continue
                    last[i] = block
        pos += 1
        store.num_tokens[rows] = pos
        last *= bs
        last += offset
        return last, copy_pairs

    def open_next_blocks(self, rows: list[int]) -> tuple[list[int], list[int]]:
        """Gives each of `rows` (distinct, their blocks full: the next token starts a block) a fresh
        block after its last; returns the blocks and their logical indices. The caller checked
        that `num_free_blocks` covers them."""
        blocks = self.take_blocks(len(rows))
        store = self.rows
        tables, refs, row_blocks, width = store.table_cells, self._refs, store.block_cells, store.max_blocks_per_seq
        logical = []
        for row, block in zip(rows, blocks):
            index = row_blocks[row]
            tables[row * width + index] = block
            refs[block] = 1
            row_blocks[row] = index + 1
            logical.append(index)
        return blocks, logical

    def decode_cursor(self, rows: list[int]) -> PagedDecodeCursor:
        """A cursor giving `rows` (no forked siblings) one slot per step (see `slot_cursor`)."""
        return PagedDecodeCursor(self, rows)

    def _copy_on_write(self, row: int, index: int, src: int) -> int:
        """Replaces shared block `src` at logical `index` of `row` by a private block; returns it."""
        block = self.take_block()
        self._refs[src] -= 1
        self._refs[block] = 1
        self.rows.table_cells[row * self.rows.max_blocks_per_seq + index] = block
        return block

    # ------------------------------------------------------------------ the pool (also the swap space's side)

    def take_blocks(self, count: int) -> list[int]:
        """`count` free device blocks: free ones first (lowest ids first), then unreferenced cached
        blocks, least recently used first (callers checked there is room)."""
        free = self._free
        if len(free) >= count:  # the usual case: one slice off the stack
            blocks = free[-count:][::-1]
            del free[-count:]
            return blocks
        evicted = self.prefix_cache.evict_many(count - len(free)) if self.prefix_cache is not None else []
        if len(free) + len(evicted) < count:
            raise RuntimeError("out of device blocks: callers must check can_admit / append_slots first")
        blocks = free[::-1] + evicted
        free.clear()
        return blocks

    def take_block(self) -> int:
        """A free device block, evicting the least recently used unreferenced cached block if needed."""
        return self.take_blocks(1)[0]

    def release_blocks(self, blocks: list[int]) -> None:
        """Decrements each device block once (blocks must be distinct) and frees those that reach 0.

        A block held by the prefix cache stays cached (evictable) instead of going free.
        """
        refs = self._refs
        unreferenced = []
        for block in blocks:
            refs[block] -= 1
            if not refs[block]:
                unreferenced.append(block)
        cache = self.prefix_cache
        self._free.extend(unreferenced if cache is None else cache.release_all(unreferenced))

    def clear_row(self, row: int) -> None:
        """Zeroes and frees a row its sequence gave up (its blocks were released)."""
        self._cache_paths.pop(row, None)
        self.rows.clear(row)
