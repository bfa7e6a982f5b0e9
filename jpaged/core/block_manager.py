"""The paged KV cache managed like virtual memory (paper §4.2–4.4).

Physical blocks of `block_size` token slots live in a device pool and a host (swap) pool. Each
sequence has a block table — a row of one persistent int32 array `[rows, max_blocks_per_seq]` —
mapping its logical blocks to physical ones. A reference count per physical block lets sequences
of a group share blocks (parallel sampling, beam search); a write into a shared block is preceded
by copy-on-write. Block 0 is reserved: padding entries point at it, so padded writes are harmless.

Hot paths are vectorized over sequences (`append_slots`); the free lists are
Python lists used as stacks (O(1) pop and push). The counters and tables live in `array.array`
buffers with numpy views of the same memory (`_int32_cells`): whole-batch operations use the
views, while the per-event paths (admit, free, fork, opening a block: a few rows and blocks each)
index the buffers with plain integers, several times cheaper than numpy scalar indexing. Pure
Python + numpy: no jax import.
"""

from __future__ import annotations

import array
from typing import Hashable

import numpy as np

from jpaged.core.decode_cursor import PagedDecodeCursor
from jpaged.core.kv_manager import AllocStatus
from jpaged.core.prefix_cache import PrefixCache, block_keys


def _int32_cells(shape: tuple[int, ...]) -> tuple[array.array, np.ndarray]:
    """Zeroed int32 cells: a flat `array.array` (fast scalar access from Python) and a numpy view
    of the same memory with `shape` (vectorized access). Writes through either show in both."""
    cells = array.array("i", bytes(4 * int(np.prod(shape))))
    assert cells.itemsize == 4
    return cells, np.frombuffer(cells, dtype=np.int32).reshape(shape)


class BlockManager:
    """Device and host block pools, reference counts and the block tables of live sequences
    (implements `kv_manager.KVCacheManager`)."""

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
        self._refs, self.refcount = _int32_cells((num_blocks,))  # [N] references from block tables
        self._block_offsets = np.arange(block_size, dtype=np.int32)  # [block_size] slot offsets in a block
        self._host_refs, self.host_refcount = _int32_cells((num_host_blocks,))  # [H] references from host tables
        # Stacks: pop() hands out the lowest id first, which keeps pictures of the pool readable.
        self._free = list(range(num_blocks - 1, 0, -1))
        self._host_free = list(range(num_host_blocks - 1, -1, -1))
        rows = max(1, max_seqs) + 1  # row 0 is reserved (see kv_manager.KVCacheManager)
        self._make_rows(rows)
        self._free_rows = list(range(rows - 1, 0, -1))
        self._row_of: dict[int, int] = {}  # seq id -> row of a resident (device) sequence
        # Row -> how far its blocks are in the prefix cache as its own (PrefixCache.insert's path).
        self._cache_paths: dict[int, tuple] = {}
        self._host_tables: dict[int, tuple[list[int], int]] = {}  # swapped seq id -> (host blocks, tokens)
        self._swapped_sets: dict[tuple[int, ...], int] = {}  # seq ids swapped out together -> distinct host blocks
        # Cached blocks without references stay off the free list until evicted on demand.
        self.prefix_cache = PrefixCache(block_size) if enable_prefix_caching else None
        # Unreferenced cached blocks: as good as free (evicted on demand).
        self._reclaimable = self.prefix_cache.evictable if self.prefix_cache is not None else ()

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Device blocks available now: free ones plus unreferenced cached ones (block 0 excluded)."""
        return len(self._free) + len(self._reclaimable)

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

    def num_slots(self, seq_id: int) -> int:
        """Tokens of `seq_id` that have a slot in its device row (0 when it holds none)."""
        row = self._row_of.get(seq_id)
        return 0 if row is None else self._row_tokens[row]

    def row_of(self, seq_id: int) -> int:
        """The block-table row of a resident sequence."""
        try:
            return self._row_of[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} holds no device blocks") from None

    def rows_of(self, seq_ids: list[int]) -> np.ndarray:
        """i64[n] block-table rows of resident sequences (KeyError names the first that is not)."""
        row_of = self._row_of
        try:
            return np.array([row_of[s] for s in seq_ids], dtype=np.int64)
        except KeyError as exc:
            raise KeyError(f"sequence {exc.args[0]} holds no device blocks") from None

    def block_table(self, seq_id: int) -> np.ndarray:
        """A copy of the physical block ids of a resident sequence, in logical order."""
        row = self.row_of(seq_id)
        return self.block_tables[row, : self.num_table_blocks[row]].copy()

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ------------------------------------------------------------------ admission

    def match_prefix(self, token_ids: list[int], cache_salt: Hashable = None,
                     keys: list[tuple[int, ...]] | None = None) -> list[int]:
        """Cached blocks holding the longest prefix of whole blocks of `token_ids` (never all of it).

        At least the last token is never a hit, so a prefill always has a token to sample from.
        `keys` (`prefix_cache.block_keys` of the tokens) saves recomputing them at every retry.
        Empty without prefix caching.
        """
        if self.prefix_cache is None:
            return []
        keys = block_keys(token_ids, self.block_size, keys)
        return self.prefix_cache.match(keys, cache_salt, (len(token_ids) - 1) // self.block_size)

    def can_admit(self, num_tokens: int, num_scheduled: int, hits: list[int] = (), *, width: int = 1,
                  final_len: int | None = None, headroom: int | None = None, extra_blocks: int = 0) -> AllocStatus:
        """Whether a sequence of `num_tokens` tokens may start now, its first `num_scheduled` getting slots.

        `hits` are its cached prefix blocks (`match_prefix`); `extra_blocks` are blocks other
        sequences of its group take in the same step. `headroom` free blocks must stay free after
        it (default: the watermark). NEVER when the sequence alone exceeds the pool or its table.
        `width` and `final_len` are unused here: paged blocks are taken as tokens come and a fork
        shares them. Contiguous managers take the same arguments and reserve by them.
        """
        bs = self.block_size
        need_total = -(-num_tokens // bs)
        if need_total > self.max_blocks_per_seq or need_total >= self.num_blocks:
            return AllocStatus.NEVER
        need = -(-num_scheduled // bs) - len(hits) + extra_blocks
        available = len(self._free) + len(self._reclaimable)
        if hits:  # a hit needs no new block, but an unreferenced cached block stops being reclaimable
            refs = self._refs
            available -= sum(1 for b in hits if refs[b] == 0)
        headroom = self.watermark_blocks if headroom is None else headroom
        return AllocStatus.OK if available - need >= headroom else AllocStatus.LATER

    def admit(self, seq_id: int, hits: list[int] = (), *, width: int = 1, final_len: int | None = None,
              num_tokens: int | None = None) -> int:
        """Gives a new sequence a block-table row holding its cached prefix `hits`; returns the row.

        Its other tokens get slots from `append_slots`. (`width`, `final_len`, `num_tokens`: see
        `can_admit`.)
        """
        if seq_id in self._row_of or seq_id in self._host_tables:
            raise ValueError(f"sequence {seq_id} already holds blocks")
        hits = list(hits)
        row = self._take_row(seq_id)
        if hits:
            refs, tables, base = self._refs, self._tables, row * self.max_blocks_per_seq
            for i, block in enumerate(hits):  # (a prefix path: distinct blocks)
                refs[block] += 1
                tables[base + i] = block
            self.prefix_cache.touch(hits)  # referenced now: no longer evictable
        self._row_blocks[row] = len(hits)
        self._row_tokens[row] = len(hits) * self.block_size
        return row

    def allocate(self, seq_id: int, num_tokens: int, hits: list[int] = ()) -> int:
        """`admit` plus slots for the first `num_tokens` tokens (at least the cached ones); returns the row."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        need = self.blocks_for(num_tokens)
        if need > self.max_blocks_per_seq:
            raise ValueError(f"{num_tokens} tokens need {need} blocks, more than the "
                             f"{self.max_blocks_per_seq} a block table holds (max_model_len)")
        reclaimed = sum(1 for b in hits if self._refs[b] == 0)
        if need - len(hits) > self.num_free_blocks - reclaimed:
            raise ValueError(f"{num_tokens} tokens need {need - len(hits)} blocks but only "
                             f"{self.num_free_blocks - reclaimed} are free (pool of {self.num_usable_blocks}); "
                             f"check can_admit first")
        row = self.admit(seq_id, hits)
        if num_tokens > len(hits) * self.block_size:
            self.append_slots(np.array([row]), np.array([num_tokens - len(hits) * self.block_size]))
        return row

    def cache_blocks(self, seq_id: int, token_ids: list[int], cache_salt: Hashable = None,
                     keys: list[tuple[int, ...]] | None = None) -> None:
        """Offers a resident sequence's full blocks (those with slots: written this step or before) to the cache."""
        if self.prefix_cache is None:
            return
        row = self.row_of(seq_id)
        num_full = min(self._row_tokens[row], len(token_ids)) // self.block_size
        resume = self._cache_paths.get(row)
        start = 0 if resume is None else resume[1]
        if start >= num_full:
            return  # every full block is in the tree already (or there is none)
        keys = block_keys(token_ids, self.block_size, keys)
        base = row * self.max_blocks_per_seq
        path = self.prefix_cache.insert(keys[start:num_full], self._tables[base + start: base + num_full], cache_salt,
                                        resume)
        if path is not None:
            self._cache_paths[row] = path

    def free(self, seq_id: int) -> None:
        """Drops a sequence's references (device or host); blocks whose count reaches 0 become free."""
        if seq_id in self._host_tables:
            host_blocks, _ = self._host_tables.pop(seq_id)
            for key in [k for k in self._swapped_sets if seq_id in k]:
                del self._swapped_sets[key]
            self._release(self._host_refs, self._host_free, host_blocks)
            return
        if seq_id not in self._row_of:
            raise KeyError(f"cannot free sequence {seq_id}: it holds no blocks (unknown or already freed)")
        row = self._row_of.pop(seq_id)
        self._release(self._refs, self._free, self._row_table(row))
        self._clear_row(row)

    def fork(self, parent_id: int, child_id: int, num_blocks: int | None = None) -> int:
        """Gives `child_id` the parent's first `num_blocks` blocks (default all), shared (count + 1).

        A partial fork (a recomputed group's sequences sharing their common history) shares only
        full blocks: the child holds `num_blocks * block_size` tokens. Returns the child's row.
        """
        if child_id in self._row_of or child_id in self._host_tables:
            raise ValueError(f"cannot fork onto sequence {child_id}: it already holds blocks")
        parent_row = self.row_of(parent_id)
        if num_blocks is not None and not 0 <= num_blocks * self.block_size <= self.num_tokens[parent_row]:
            raise ValueError(f"cannot fork {num_blocks} blocks of sequence {parent_id}: it holds "
                             f"{self.num_tokens[parent_row] // self.block_size} full blocks")
        row = self._take_row(child_id)
        n = self._row_blocks[parent_row] if num_blocks is None else num_blocks
        blocks = self._row_table(parent_row)[:n]
        self.block_tables[row, :n] = blocks
        refs = self._refs
        for block in blocks:
            refs[block] += 1
        self._row_blocks[row] = n
        self._row_tokens[row] = self._row_tokens[parent_row] if num_blocks is None else n * self.block_size
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
        bs = self.block_size
        pos = self.num_tokens[rows]  # [n] first new position of each row
        end = pos + counts
        have = self.num_table_blocks[rows]
        new_blocks = (end + bs - 1) // bs - have  # [n] blocks to open
        if (end > self.max_blocks_per_seq * bs).any():
            raise ValueError("append_slots: a row would outgrow its block table (max_model_len)")
        last = self.block_tables[rows, np.maximum(have - 1, 0)]  # [n] current last block
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
        self.num_tokens[rows] = end
        # Position of every new token: row i owns [pos[i], end[i]).
        token_rows = np.repeat(rows, counts)
        starts = np.cumsum(counts) - counts
        positions = np.arange(int(counts.sum())) - np.repeat(starts - pos, counts)
        slots = self.block_tables[token_rows, positions // bs] * bs + positions % bs
        return slots.astype(np.int32, copy=False), copy_pairs

    def append_row(self, row: int, count: int) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        """`append_slots` for one row and `count` tokens (the same rules): a prompt chunk at
        admission, with plain integers (a dozen array operations cost more on one row)."""
        bs, base = self.block_size, row * self.max_blocks_per_seq
        pos, have = self._row_tokens[row], self._row_blocks[row]
        end = pos + count
        if end > self.max_blocks_per_seq * bs:
            raise ValueError("append_slots: a row would outgrow its block table (max_model_len)")
        new_blocks = -(-end // bs) - have
        src = self._tables[base + have - 1] if have else 0
        cow = pos % bs != 0 and self._refs[src] > 1  # the first new token lands in a shared block
        if new_blocks + cow > self.num_free_blocks:
            return None
        copy_pairs = [(src, self._copy_on_write(row, have - 1, src))] if cow else []
        if new_blocks:
            self._open_blocks(row, have, new_blocks)
        self._row_tokens[row] = end
        first, offset = divmod(pos, bs)
        if end <= (first + 1) * bs:  # all in one block: a run of slots
            start = self._tables[base + first] * bs + offset
            return np.arange(start, start + count, dtype=np.int32), copy_pairs
        # The slots of positions [pos, end): the rows' blocks [pos // bs, ceil(end / bs)) laid out
        # slot by slot, less the first block's offset (one slice and one broadcast, no gather).
        blocks = self.block_tables[row, first: -(-end // bs)]
        slots = (blocks[:, None] * bs + self._block_offsets).ravel()
        return slots[offset: offset + count], copy_pairs

    def _open_blocks(self, row: int, first: int, count: int) -> None:
        """Appends `count` fresh blocks to `row`'s table from logical index `first` (room was checked)."""
        blocks = self._take_blocks(count)
        tables, refs, base = self._tables, self._refs, row * self.max_blocks_per_seq + first
        for i, block in enumerate(blocks):
            tables[base + i] = block
            refs[block] = 1
        self._row_blocks[row] = first + count

    def blocks_needed(self, rows: list[int], counts: list[int] | None = None) -> int:
        """Blocks `append_slots(rows, counts)` would take now: new ones past each row's last full
        block, plus a copy of a shared last block about to be written (counted per row)."""
        bs, width, tables, refs = self.block_size, self.max_blocks_per_seq, self._tables, self._refs
        total = 0
        for i, row in enumerate(rows):
            pos, have = self._row_tokens[row], self._row_blocks[row]
            total += -(-(pos + (1 if counts is None else counts[i])) // bs) - have
            if pos % bs and refs[tables[row * width + have - 1]] > 1:
                total += 1
        return total

    def _append_one(self, rows: np.ndarray, may_share: bool) -> tuple[np.ndarray, list[tuple[int, int]]] | None:
        # Every decode step, for every sequence: a handful of whole-batch numpy operations, with a
        # Python loop only over the rows that open a block (or copy a shared one).
        bs = self.block_size
        pos = self.num_tokens[rows]  # [n] position of each row's new token
        logical, offset = np.divmod(pos, bs)  # [n] the block it lands in, and where in it
        # Table entries past a row's blocks are 0 and refcount[0] is 0, so a row that opens a new
        # block never looks shared. An index past the table width raises IndexError: the engine
        # finishes every sequence at max_model_len, so that is a caller bug.
        last = self.block_tables[rows, logical]  # [n] physical block each row writes into
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
                        block = self._take_block()
                        self._tables[row * self.max_blocks_per_seq + idx] = block
                        self._refs[block] = 1
                        self._row_blocks[row] = idx + 1
                    elif self._refs[src] > 1:  # shared: copy-on-write (re-checked: an earlier row may have copied)
                        block = self._copy_on_write(row, idx, src)
                        copy_pairs.append((src, block))
                    else:
                        continue
                    last[i] = block
        pos += 1
        self.num_tokens[rows] = pos
        last *= bs
        last += offset
        return last, copy_pairs

    def open_next_blocks(self, rows: list[int]) -> tuple[list[int], list[int]]:
        """Gives each of `rows` (distinct, their blocks full: the next token starts a block) a fresh
        block after its last; returns the blocks and their logical indices. The caller checked
        that `num_free_blocks` covers them."""
        blocks = self._take_blocks(len(rows))
        tables, refs, row_blocks, width = self._tables, self._refs, self._row_blocks, self.max_blocks_per_seq
        logical = []
        for row, block in zip(rows, blocks):
            index = row_blocks[row]
            tables[row * width + index] = block
            refs[block] = 1
            row_blocks[row] = index + 1
            logical.append(index)
        return blocks, logical

    def decode_cursor(self, rows: list[int]) -> PagedDecodeCursor:
        """A cursor giving `rows` (no forked siblings) one slot per step (see `decode_cursor`)."""
        return PagedDecodeCursor(self, rows)

    def _copy_on_write(self, row: int, index: int, src: int) -> int:
        """Replaces shared block `src` at logical `index` of `row` by a private block; returns it."""
        block = self._take_block()
        self._refs[src] -= 1
        self._refs[block] = 1
        self._tables[row * self.max_blocks_per_seq + index] = block
        return block

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
            self._host_refs[host] = count
            host_of[block] = host
        for s in seq_ids:
            row = self._row_of.pop(s)
            blocks = self._row_table(row)
            self._host_tables[s] = ([host_of[b] for b in blocks], self._row_tokens[row])
            self._release(self._refs, self._free, blocks)
            self._clear_row(row)
        self._swapped_sets[tuple(seq_ids)] = len(host_of)
        return list(host_of.items())

    def swapped_blocks(self, seq_ids: list[int]) -> int:
        """Distinct host blocks of these swapped sequences: device blocks they need to come back."""
        # A group is usually retried every step until it fits: remember its block count.
        num_blocks = self._swapped_sets.get(tuple(seq_ids))
        if num_blocks is None:
            num_blocks = len(self._unique_blocks(lambda s: self._host_tables[s][0], seq_ids)[0])
        return num_blocks

    def can_swap_in(self, seq_ids: list[int], extra_blocks: int = 0, headroom: int | None = None) -> bool:
        """Whether the device pool has room for these swapped sequences plus `extra_blocks`, keeping
        `headroom` blocks free (default: the watermark)."""
        headroom = self.watermark_blocks if headroom is None else headroom
        return self.swapped_blocks(seq_ids) + extra_blocks <= self.num_free_blocks - headroom

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
            self._refs[block] = count
            device_of[host] = block
        for s in seq_ids:
            host_blocks, num_tokens = self._host_tables.pop(s)
            row = self._take_row(s)
            self.block_tables[row, : len(host_blocks)] = [device_of[h] for h in host_blocks]
            self._row_blocks[row] = len(host_blocks)
            self._row_tokens[row] = num_tokens
            self._release(self._host_refs, self._host_free, host_blocks)
        return list(device_of.items())

    # ------------------------------------------------------------------ accounting

    def usage_breakdown(self, final_lens: dict[int, int], next_request: tuple[int, int] | None = None
                        ) -> tuple[int, int, int, int]:
        """(token_states, reserved, internal, external) slots now (paper Fig. 2); shared blocks count once.

        `final_lens` maps every resident sequence id to its final length; a sequence writes K/V
        for its first final_len - 1 positions. Per distinct allocated block: written = the most
        slots any holder has written, will = the most any holder will write; token_states +=
        written, reserved += will - written, internal += block_size - will. A paged pool has no
        external fragmentation (any free block serves any request), so `next_request` is unused.
        """
        rows = np.fromiter((self.row_of(s) for s in final_lens), dtype=np.int64, count=len(final_lens))
        wills = np.fromiter((f - 1 for f in final_lens.values()), dtype=np.int64, count=len(final_lens))
        num_allocated = int(np.count_nonzero(self.refcount[1:]))
        bs = self.block_size
        if rows.size == 0:
            return 0, 0, num_allocated * bs, 0
        width = int(self.num_table_blocks[rows].max())
        first_pos = np.arange(width)[None, :] * bs  # [1, W] first position of each logical block
        valid = np.arange(width)[None, :] < self.num_table_blocks[rows][:, None]  # [R, W]
        written = np.clip(self.num_tokens[rows][:, None] - first_pos, 0, bs)  # [R, W]
        will = np.maximum(np.clip(wills[:, None] - first_pos, 0, bs), written)
        blocks = self.block_tables[rows, :width][valid]
        per_written = np.zeros(self.num_blocks, dtype=np.int64)
        per_will = np.zeros(self.num_blocks, dtype=np.int64)
        np.maximum.at(per_written, blocks, written[valid])
        np.maximum.at(per_will, blocks, will[valid])
        token, future = int(per_written.sum()), int(per_will.sum())
        return token, future - token, num_allocated * bs - future, 0

    # ------------------------------------------------------------------ internals

    def _take_blocks(self, count: int) -> list[int]:
        """`count` free device blocks: free ones first (lowest ids first), then unreferenced cached
        blocks, least recently used first (callers checked there is room)."""
        free = self._free
        if len(free) >= count:  # the usual case: one slice off the stack
            blocks = free[-count:][::-1]
            del free[-count:]
            return blocks
        evicted = self.prefix_cache.evict_many(count - len(free)) if self.prefix_cache is not None else []
        if len(free) + len(evicted) < count:
            raise RuntimeError("out of device blocks: callers must check can_allocate / append_slots first")
        blocks = free[::-1] + evicted
        free.clear()
        return blocks

    def _take_block(self) -> int:
        """A free device block, evicting the least recently used unreferenced cached block if needed."""
        return self._take_blocks(1)[0]

    def _take_row(self, seq_id: int) -> int:
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        return row

    def _make_rows(self, rows: int) -> None:
        """Zeroed block tables and row counters for `rows` rows (buffers and their numpy views)."""
        self._tables, self.block_tables = _int32_cells((rows, self.max_blocks_per_seq))  # [rows, M]
        self._row_blocks, self.num_table_blocks = _int32_cells((rows,))  # [rows] logical blocks in use per row
        self._row_tokens, self.num_tokens = _int32_cells((rows,))  # [rows] tokens that have a slot per row

    def _grow_rows(self) -> None:
        """Doubles the rows, keeping the live ones (new buffers: views of the old stay valid)."""
        old = len(self._row_tokens)
        tables, row_blocks, row_tokens = self._tables, self._row_blocks, self._row_tokens
        self._make_rows(2 * old)
        self._tables[: len(tables)] = tables
        self._row_blocks[:old] = row_blocks
        self._row_tokens[:old] = row_tokens
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def _row_table(self, row: int) -> list[int]:
        """The blocks of a row's table, in logical order."""
        base = row * self.max_blocks_per_seq
        return self._tables[base: base + self._row_blocks[row]].tolist()

    def _clear_row(self, row: int) -> None:
        self._cache_paths.pop(row, None)
        n = self._row_blocks[row]
        if n:  # (an empty slice assignment would raise: the buffer is exported)
            base = row * self.max_blocks_per_seq
            self._tables[base: base + n] = array.array("i", bytes(4 * n))
        self._row_blocks[row] = 0
        self._row_tokens[row] = 0
        self._free_rows.append(row)

    def _release(self, refs: array.array, free_list: list[int], blocks: list[int]) -> None:
        """Decrements each block once (blocks must be distinct) and frees those that reach 0.

        A device block held by the prefix cache stays cached (evictable) instead of going free.
        """
        unreferenced = []
        for block in blocks:
            refs[block] -= 1
            if not refs[block]:
                unreferenced.append(block)
        cache = self.prefix_cache
        if cache is None or free_list is self._host_free:
            free_list.extend(unreferenced)
            return
        free_list.extend(cache.release_all(unreferenced))
