"""The paged KV cache managed like virtual memory (paper §4.2–4.4).

Physical blocks of `block_size` token slots live in a device pool and a host (swap) pool. Each
sequence has a block table — a row of one persistent int32 array `[rows, max_blocks_per_seq]` —
mapping its logical blocks to physical ones. A reference count per physical block lets sequences
of a group share blocks (parallel sampling, beam search); a write into a shared block is preceded
by copy-on-write. Block 0 is reserved: padding entries point at it, so padded writes are harmless.

Hot paths are vectorized over sequences (`append_slots`, `slot_mapping`); the free lists are
Python lists used as stacks (O(1) pop and push). Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import enum
from typing import Hashable

import numpy as np

from jpaged.prefix_cache import PrefixCache, block_keys


class AllocStatus(enum.Enum):
    """Answer of `can_allocate`."""

    OK = "ok"  # enough free blocks now (above the watermark)
    LATER = "later"  # fits in the pool, not now
    NEVER = "never"  # needs more blocks than the whole pool (or the table width): reject


class BlockManager:
    """Device and host block pools, reference counts and the block tables of live sequences."""

    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int, max_model_len: int,
                 watermark: float = 0.01, max_seqs: int = 256, enable_prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be >= 0, got {num_host_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.watermark_blocks = int(watermark * (num_blocks - 1))
        self.refcount = np.zeros(num_blocks, dtype=np.int32)  # [N] references from block tables
        self.host_refcount = np.zeros(num_host_blocks, dtype=np.int32)  # [H] references from host tables
        # Stacks: pop() hands out the lowest id first, which keeps pictures of the pool readable.
        self._free = list(range(num_blocks - 1, 0, -1))
        self._host_free = list(range(num_host_blocks - 1, -1, -1))
        rows = max(1, max_seqs)
        self.block_tables = np.zeros((rows, self.max_blocks_per_seq), dtype=np.int32)  # [rows, M]
        self.num_table_blocks = np.zeros(rows, dtype=np.int32)  # [rows] logical blocks in use per row
        self.num_tokens = np.zeros(rows, dtype=np.int32)  # [rows] tokens that have a slot per row
        self._free_rows = list(range(rows - 1, -1, -1))
        self._row_of: dict[int, int] = {}  # seq id -> row of a resident (device) sequence
        self._host_tables: dict[int, tuple[list[int], int]] = {}  # swapped seq id -> (host blocks, tokens)
        self._swapped_sets: dict[tuple[int, ...], int] = {}  # seq ids swapped out together -> distinct host blocks
        # Cached blocks without references stay off the free list until evicted on demand.
        self.prefix_cache = (PrefixCache(block_size, lambda block: self.refcount[block] > 0)
                             if enable_prefix_caching else None)

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Device blocks available now: free ones plus unreferenced cached ones (block 0 excluded)."""
        if self.prefix_cache is None:
            return len(self._free)
        return len(self._free) + self.prefix_cache.num_evictable

    @property
    def num_usable_blocks(self) -> int:
        """Device blocks that can hold tokens (all but block 0)."""
        return self.num_blocks - 1

    @property
    def num_free_host_blocks(self) -> int:
        """Free host (swap) blocks."""
        return len(self._host_free)

    def usage(self) -> float:
        """Fraction of usable device blocks referenced by live sequences."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def has_seq(self, seq_id: int) -> bool:
        """True when `seq_id` holds device blocks."""
        return seq_id in self._row_of

    def is_swapped(self, seq_id: int) -> bool:
        """True when `seq_id` holds host blocks."""
        return seq_id in self._host_tables

    def row_of(self, seq_id: int) -> int:
        """The block-table row of a resident sequence."""
        try:
            return self._row_of[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} holds no device blocks") from None

    def block_table(self, seq_id: int) -> np.ndarray:
        """A copy of the physical block ids of a resident sequence, in logical order."""
        row = self.row_of(seq_id)
        return self.block_tables[row, : self.num_table_blocks[row]].copy()

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ allocate / free

    def can_allocate(self, num_tokens: int, num_seqs: int = 1, final_len: int | None = None, *,
                     token_ids: list[int] | None = None, cache_salt: Hashable = None,
                     keys: list[tuple[int, ...]] | None = None) -> AllocStatus:
        """Whether `num_seqs` fresh sequences of `num_tokens` tokens each fit, keeping the watermark free.

        With prefix caching and `token_ids`, blocks of the cached prefix count as already there;
        `keys` (`prefix_cache.block_keys` of the tokens) saves recomputing them at every retry.
        `final_len` (the most tokens a sequence may reach) is unused here: paged allocation reserves
        nothing ahead. Contiguous baselines take the same arguments and reserve by it.
        """
        need_per_seq = self.blocks_for(num_tokens)
        need = need_per_seq * num_seqs
        if need_per_seq > self.max_blocks_per_seq or need > self.num_usable_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        available = self.num_free_blocks
        if self.prefix_cache is not None and token_ids is not None and num_seqs == 1:
            hits = self._match(token_ids, cache_salt, keys)
            # A hit needs no new block, but an unreferenced one stops being reclaimable.
            need -= len(hits)
            available -= sum(1 for b in hits if self.refcount[b] == 0)
        return AllocStatus.OK if available - need >= self.watermark_blocks else AllocStatus.LATER

    def allocate(self, seq_id: int, num_tokens: int, final_len: int | None = None) -> int:
        """Gives a new sequence blocks for its first `num_tokens` tokens; returns its table row."""
        return self._allocate(seq_id, num_tokens, [])

    def allocate_with_prefix(self, seq_id: int, token_ids: list[int], cache_salt: Hashable = None,
                             keys: list[tuple[int, ...]] | None = None) -> tuple[int, int]:
        """Allocates like `allocate`, sharing the longest cached prefix of whole blocks.

        Returns (row, cached tokens). At least the last token is never a hit, so the prefill has
        a token to compute logits from.
        """
        if self.prefix_cache is None:
            raise ValueError("allocate_with_prefix needs enable_prefix_caching=True")
        hits = self._match(token_ids, cache_salt, keys)
        row = self._allocate(seq_id, len(token_ids), hits)
        return row, len(hits) * self.block_size

    def cache_blocks(self, seq_id: int, token_ids: list[int], cache_salt: Hashable = None,
                     keys: list[tuple[int, ...]] | None = None) -> None:
        """Offers a resident sequence's full blocks (those whose K/V is written) to the prefix cache."""
        if self.prefix_cache is None:
            return
        row = self.row_of(seq_id)
        num_full = min(int(self.num_tokens[row]), len(token_ids)) // self.block_size
        keys = block_keys(token_ids, self.block_size, keys)[:num_full]
        self.prefix_cache.insert(keys, self.block_tables[row, :num_full].tolist(), cache_salt)

    def _match(self, token_ids: list[int], cache_salt: Hashable, keys: list[tuple[int, ...]] | None) -> list[int]:
        keys = block_keys(token_ids, self.block_size, keys)
        return self.prefix_cache.match(keys, cache_salt, (len(token_ids) - 1) // self.block_size)

    def _allocate(self, seq_id: int, num_tokens: int, shared: list[int]) -> int:
        if seq_id in self._row_of or seq_id in self._host_tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        need = self.blocks_for(num_tokens)
        if need > self.max_blocks_per_seq:
            raise ValueError(f"{num_tokens} tokens need {need} blocks, more than the "
                             f"{self.max_blocks_per_seq} a block table holds (max_model_len)")
        reclaimed = sum(1 for b in shared if self.refcount[b] == 0)
        if need - len(shared) > self.num_free_blocks - reclaimed:
            raise ValueError(f"{num_tokens} tokens need {need - len(shared)} blocks but only "
                             f"{self.num_free_blocks - reclaimed} are free (pool of {self.num_usable_blocks}); "
                             f"check can_allocate first")
        row = self._take_row(seq_id)
        if shared:
            self.refcount[shared] += 1
            self.prefix_cache.touch(shared)  # referenced now: no longer evictable
        blocks = shared + [self._take_block() for _ in range(need - len(shared))]
        self.block_tables[row, :need] = blocks
        self.refcount[blocks[len(shared):]] = 1
        self.num_table_blocks[row] = need
        self.num_tokens[row] = num_tokens
        return row

    def free(self, seq_id: int) -> None:
        """Drops a sequence's references (device or host); blocks whose count reaches 0 become free."""
        if seq_id in self._host_tables:
            host_blocks, _ = self._host_tables.pop(seq_id)
            for key in [k for k in self._swapped_sets if seq_id in k]:
                del self._swapped_sets[key]
            self._release(self.host_refcount, self._host_free, np.asarray(host_blocks, dtype=np.int64))
            return
        if seq_id not in self._row_of:
            raise KeyError(f"cannot free sequence {seq_id}: it holds no blocks (unknown or already freed)")
        row = self._row_of.pop(seq_id)
        self._release(self.refcount, self._free, self.block_tables[row, : self.num_table_blocks[row]])
        self._clear_row(row)

    def fork(self, parent_id: int, child_id: int) -> int:
        """Gives `child_id` the parent's block table, sharing every block (count + 1); returns its row."""
        if child_id in self._row_of or child_id in self._host_tables:
            raise ValueError(f"cannot fork onto sequence {child_id}: it already holds blocks")
        parent_row = self.row_of(parent_id)
        row = self._take_row(child_id)
        n = self.num_table_blocks[parent_row]
        blocks = self.block_tables[parent_row, :n]
        self.block_tables[row, :n] = blocks
        self.refcount[blocks] += 1
        self.num_table_blocks[row] = n
        self.num_tokens[row] = self.num_tokens[parent_row]
        return row

    # ------------------------------------------------------------------ append (decode hot path)

    def blocks_needed_to_append(self, rows: np.ndarray) -> int:
        """Upper bound on blocks `append_slots(rows)` takes: new blocks plus copy-on-write copies."""
        pos = self.num_tokens[rows]
        opens_block = pos % self.block_size == 0
        last = self.block_tables[rows, np.minimum(pos // self.block_size, self.max_blocks_per_seq - 1)]
        shared = ~opens_block & (self.refcount[last] > 1)
        return int(opens_block.sum() + shared.sum())

    def can_append_slots(self, rows: np.ndarray) -> bool:
        """Whether every row in `rows` can surely get a slot for one more token."""
        return self.blocks_needed_to_append(rows) <= self.num_free_blocks

    def append_slots(self, rows: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        """Gives each row a slot for one more token, or returns None (changing nothing) if blocks run out.

        A new block is taken only when the row's last block is full; a shared last block is copied
        first (copy-on-write). Returns the slots i32[len(rows)] and the (src, dst) copy pairs.
        This runs every decode step for every sequence: one pass of vectorized numpy, with Python
        loops only over the few rows that open a block or copy one.
        """
        bs = self.block_size
        pos = self.num_tokens[rows]
        logical = pos // bs
        offset = pos - logical * bs
        # Table entries past a row's blocks are 0 and refcount[0] is 0, so a row that opens a new
        # block never looks shared. An index past the table width raises IndexError: the engine
        # finishes every sequence at max_model_len, so that is a caller bug.
        last = self.block_tables[rows, logical]  # [n] physical block each row writes into
        needs_block = np.flatnonzero((offset == 0) | (self.refcount[last] > 1)).tolist()
        if len(needs_block) > self.num_free_blocks:
            return None
        copy_pairs: list[tuple[int, int]] = []
        for i in needs_block:
            row, idx = int(rows[i]), int(logical[i])
            src = int(last[i])
            if src == 0:  # the row's last block is full: open a new one
                block = self._take_block()
                self.block_tables[row, idx] = block
                self.refcount[block] = 1
                self.num_table_blocks[row] = idx + 1
            elif self.refcount[src] > 1:  # shared: copy-on-write (re-checked: an earlier row may have copied)
                block = self._take_block()
                self.refcount[src] -= 1
                self.refcount[block] = 1
                self.block_tables[row, idx] = block
                copy_pairs.append((src, block))
            else:
                continue
            last[i] = block
        self.num_tokens[rows] = pos + 1
        return (last * bs + offset).astype(np.int32, copy=False), copy_pairs

    def slot_mapping(self, row: int, start: int, end: int) -> np.ndarray:
        """Slots of positions [start, end) of a row's sequence: table[p // B] * B + p % B."""
        pos = np.arange(start, end)
        return (self.block_tables[row, pos // self.block_size] * self.block_size
                + pos % self.block_size).astype(np.int32)

    # ------------------------------------------------------------------ swap

    def _unique_blocks(self, table_of, seq_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
        blocks = np.concatenate([np.asarray(table_of(s), dtype=np.int64) for s in seq_ids])
        return np.unique(blocks, return_counts=True)

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        """Whether the host pool has room for every distinct block of these resident sequences."""
        if self.num_host_blocks == 0:
            return False
        blocks, _ = self._unique_blocks(self.block_table, seq_ids)
        return len(blocks) <= len(self._host_free)

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Moves a group's sequences to host memory, all or nothing; returns (device, host) copy pairs.

        A block shared inside the group is copied once and stays shared on the host. A block also
        referenced outside the group keeps its device copy for those references.
        """
        if self.num_host_blocks == 0:
            raise ValueError("cannot swap out: no swap space (cache.num_host_blocks = 0)")
        for s in seq_ids:
            self.row_of(s)
        blocks, counts = self._unique_blocks(self.block_table, seq_ids)
        if len(blocks) > len(self._host_free):
            raise ValueError(f"cannot swap out: {len(blocks)} blocks needed, {len(self._host_free)} host blocks free")
        host_of = {}
        for block, count in zip(blocks.tolist(), counts.tolist()):
            host = self._host_free.pop()
            self.host_refcount[host] = count
            host_of[block] = host
        for s in seq_ids:
            row = self._row_of.pop(s)
            n = self.num_table_blocks[row]
            self._host_tables[s] = ([host_of[b] for b in self.block_tables[row, :n].tolist()],
                                    int(self.num_tokens[row]))
            self._release(self.refcount, self._free, self.block_tables[row, :n])
            self._clear_row(row)
        self._swapped_sets[tuple(seq_ids)] = len(host_of)
        return list(host_of.items())

    def can_swap_in(self, seq_ids: list[int], extra_blocks: int = 0) -> bool:
        """Whether the device pool has room for these swapped sequences plus `extra_blocks`."""
        # A group is usually retried every step until it fits: remember its block count.
        num_blocks = self._swapped_sets.get(tuple(seq_ids))
        if num_blocks is None:
            num_blocks = len(self._unique_blocks(lambda s: self._host_tables[s][0], seq_ids)[0])
        return num_blocks + extra_blocks <= self.num_free_blocks - self.watermark_blocks

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Brings a group's swapped sequences back to the device; returns (host, device) copy pairs."""
        for s in seq_ids:
            if s not in self._host_tables:
                raise KeyError(f"sequence {s} is not swapped out")
        blocks, counts = self._unique_blocks(lambda s: self._host_tables[s][0], seq_ids)
        if len(blocks) > self.num_free_blocks:
            raise ValueError(f"cannot swap in: {len(blocks)} blocks needed, {self.num_free_blocks} free")
        self._swapped_sets.pop(tuple(seq_ids), None)
        device_of = {}
        for host, count in zip(blocks.tolist(), counts.tolist()):
            block = self._take_block()
            self.refcount[block] = count
            device_of[host] = block
        for s in seq_ids:
            host_blocks, num_tokens = self._host_tables.pop(s)
            row = self._take_row(s)
            self.block_tables[row, : len(host_blocks)] = [device_of[h] for h in host_blocks]
            self.num_table_blocks[row] = len(host_blocks)
            self.num_tokens[row] = num_tokens
            self._release(self.host_refcount, self._host_free, np.asarray(host_blocks, dtype=np.int64))
        return list(device_of.items())

    # ------------------------------------------------------------------ accounting

    def token_slots_in_use(self) -> tuple[int, int]:
        """(slots holding token states, allocated slots) over distinct device blocks in use."""
        rows = np.fromiter(self._row_of.values(), dtype=np.int64, count=len(self._row_of))
        if rows.size == 0:
            return 0, 0
        bs = self.block_size
        width = self.max_blocks_per_seq
        logical = np.arange(width)[None, :]
        nblocks = self.num_table_blocks[rows][:, None]
        valid = logical < nblocks
        fill = np.clip(self.num_tokens[rows][:, None] - logical * bs, 0, bs)
        blocks = self.block_tables[rows][valid]
        # A shared block holds the same tokens for every sharer; count it once (its largest fill).
        per_block = np.zeros(self.num_blocks, dtype=np.int64)
        np.maximum.at(per_block, blocks, fill[valid])
        return int(per_block.sum()), int((self.num_usable_blocks - self.num_free_blocks) * bs)

    # ------------------------------------------------------------------ internals

    def _take_block(self) -> int:
        """A free device block, evicting the least recently used unreferenced cached block if needed."""
        if self._free:
            return self._free.pop()
        block = self.prefix_cache.evict() if self.prefix_cache is not None else None
        if block is None:
            raise RuntimeError("out of device blocks: callers must check can_allocate / append_slots first")
        return block

    def _take_row(self, seq_id: int) -> int:
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        return row

    def _grow_rows(self) -> None:
        old = len(self.num_tokens)
        self.block_tables = np.concatenate([self.block_tables, np.zeros_like(self.block_tables)])
        self.num_table_blocks = np.concatenate([self.num_table_blocks, np.zeros(old, dtype=np.int32)])
        self.num_tokens = np.concatenate([self.num_tokens, np.zeros(old, dtype=np.int32)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _clear_row(self, row: int) -> None:
        self.block_tables[row, : self.num_table_blocks[row]] = 0
        self.num_table_blocks[row] = 0
        self.num_tokens[row] = 0
        self._free_rows.append(row)

    def _release(self, refcount: np.ndarray, free_list: list[int], blocks: np.ndarray) -> None:
        """Decrements each block once (blocks must be distinct) and frees those that reach 0.

        A device block held by the prefix cache stays cached (evictable) instead of going free.
        """
        refcount[blocks] -= 1
        unreferenced = blocks[refcount[blocks] == 0].tolist()
        cache = self.prefix_cache
        if cache is None or free_list is self._host_free:
            free_list.extend(unreferenced)
            return
        for block in unreferenced:
            if block in cache:
                cache.release(block)
            else:
                free_list.append(block)
