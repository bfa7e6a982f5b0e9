"""Orca's contiguous KV cache behind the paged block manager's interface (paper §6.1).

Each sequence gets one contiguous region, placed by a buddy allocator, sized by a reservation
policy (Oracle: prompt + true output; Pow2: output rounded up to a power of two; Max: the maximum
sequence length). The buddy works in units of one KV block, so every region is block-aligned and
at least one block, and a region at buddy offset `o` is the consecutive block ids o+1, o+2, ...
(block 0 stays the reserved padding target). Block tables therefore stay valid, and the same
scheduler, StepPlans and executors (simulated or real) serve Orca and vLLM alike.

A reservation covers the sequence's final length, so appending never fails and Orca never
preempts; there is no swap space and no prefix cache. The block-table rows are the paged
manager's own `RowStore`; what is contiguous-only (regions, reservations, the fork family) is here.

Requests with several sequences (parallel sampling, beam search) share nothing: a group of width
n reserves n regions at admission (`width = n`), and `fork` gives
the child one of the group's spare regions and copies the parent's written blocks into it (the
copy pairs go out with the next `append_slots`, so the executor copies before the model writes).
A region freed while its group lives goes back to the group's spares, since beam search forks
again. Beam search may fork before it drops the beams it replaces; a child forked with no spare
waits for the next sibling's region freed in that same beam step. Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import numpy as np

from jpaged.core.kv.slot_cursor import AppendCursor
from jpaged.core.kv.prefix_cache import NO_HIT, PrefixHit
from jpaged.core.kv.row_store import RowStore
from jpaged.paper.baselines.buddy import BuddyAllocator, Policy, order_of, reservation


class ContiguousBlockManager:
    """One buddy-placed contiguous region per sequence, reserved ahead by an Orca policy
    (implements `kv_manager.KVCacheManager`)."""

    prefix_cache = None  # no prefix sharing in the contiguous baselines
    num_pinned_blocks = 0  # (so no pinned prefix either)
    swap = None  # no swap space: Orca never preempts (nothing grows past its reservation)

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, policy: Policy,
                 max_seqs: int = 256):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if policy not in ("oracle", "pow2", "max"):
            raise ValueError(f"policy must be 'oracle', 'pow2' or 'max', got {policy!r}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self.policy = policy
        self.buddy = BuddyAllocator(num_blocks - 1)  # unit = one block; unit u is block u + 1
        # The rows hold the blocks in use (`num_table_blocks`: blocks holding tokens); each row's
        # region, reserved whole at admission, is per row beside them (grown with the store).
        self.rows = RowStore(block_size, -(-max_model_len // block_size), max(1, max_seqs) + 1)
        rows = self.rows.num_rows
        self.base = np.zeros(rows, dtype=np.int64)  # [rows] first block id of the row's region
        self.region_blocks = np.zeros(rows, dtype=np.int64)  # [rows] blocks in the region (a power of two)
        self.final_len = np.zeros(rows, dtype=np.int64)  # [rows] prompt + max_tokens of the sequence
        # Groups of forked sequences, keyed by the id of the sequence admitted first (the root).
        self._family: dict[int, int] = {}  # seq id -> root id
        self._members: dict[int, int] = {}  # root id -> live sequences holding a row
        self._spares: dict[int, list[int]] = {}  # root id -> buddy offsets of reserved, unused regions
        self._waiting_forks: dict[int, list[tuple[int, int]]] = {}  # root id -> (child, parent) without a region
        self._copies: dict[int, list[tuple[int, int]]] = {}  # root id -> (src, dst) block copies not yet issued

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks in free buddy regions (not all of them usable by one request)."""
        return self.buddy.free_units

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold tokens (all but block 0)."""
        return self.num_blocks - 1

    @property
    def num_events(self) -> int:
        """Block events so far: sequences taking or giving up their regions' rows."""
        return self.rows.num_changes

    def region(self, seq_id: int) -> tuple[int, int]:
        """(first block id, number of blocks) of the sequence's whole reserved region."""
        row = self.rows.row_of(seq_id)
        return int(self.base[row]), int(self.region_blocks[row])

    def reserved_blocks(self, num_tokens: int, final_len: int) -> int:
        """Blocks the policy asks the buddy for: the token reservation rounded up to whole blocks.

        `num_tokens` are the tokens present at admission (the prompt); the rest of `final_len`
        is the output to reserve for.
        """
        if final_len is None or final_len <= num_tokens:
            raise ValueError(f"final_len must exceed num_tokens ({num_tokens}) for a contiguous "
                             f"reservation, got {final_len}")
        tokens = reservation(self.policy, num_tokens, final_len - num_tokens, self.max_model_len)
        return self.rows.blocks_for(tokens)

    # ------------------------------------------------------------------ admission

    def match_prefix(self, token_ids: list[int], cache_salt=None, keys=None) -> PrefixHit:
        """Always NO_HIT: the contiguous baselines share no prefix."""
        return NO_HIT

    def num_shared_pinned(self, hits: PrefixHit) -> int:
        """Always 0: nothing is pinned here."""
        return 0

    def fits(self, num_tokens: int, *, width: int = 1, final_len: int | None = None, extra_blocks: int = 0,
             hits: PrefixHit = NO_HIT) -> bool:
        """Whether `width` regions for sequences of `num_tokens` tokens growing to `final_len` could
        ever be placed, the buddy empty (a block of order o holds 2^(o - k) regions of order k).
        Before the reservation can be sized (`final_len` None: the door checks the prompt) only
        the tokens themselves must fit. (`extra_blocks`: none here; forks take reserved regions;
        `hits`: always NO_HIT here.)"""
        if final_len is None:
            need = self.rows.blocks_for(num_tokens)
            return need <= self.rows.max_blocks_per_seq and need <= self.num_usable_blocks
        k = order_of(self.reserved_blocks(num_tokens, final_len))
        return k <= self.buddy.max_order and self.buddy.num_units >> k >= width

    def can_admit(self, num_tokens: int, num_scheduled: int, hits: PrefixHit = NO_HIT, *, width: int = 1,
                  final_len: int | None = None, headroom: int | None = None, extra_blocks: int = 0) -> bool:
        """Whether `width` regions for sequences of `num_tokens` tokens growing to `final_len` fit now.

        The whole reservation is taken at admission, so `num_scheduled`, `headroom` and
        `extra_blocks` do not matter. A free buddy block of order o holds 2^(o - k) regions of
        order k, so the count is exact.
        """
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        k = order_of(self.reserved_blocks(num_tokens, final_len))
        if width == 1:  # the common case, O(log n)
            return self.buddy.can_allocate(1 << k)
        return sum(units >> k for _, units in self.buddy.free_blocks()) >= width

    def admit(self, seq_id: int, hits: PrefixHit = NO_HIT, *, width: int = 1, final_len: int | None = None,
              num_tokens: int | None = None) -> int:
        """Reserves a region for a new sequence of `num_tokens` tokens growing to `final_len`, plus
        `width - 1` spare regions for the sequences its group forks into; returns its row. Its
        tokens get slots from `append_slots`."""
        if self.rows.has_seq(seq_id):
            raise ValueError(f"sequence {seq_id} already holds a region")
        need = self.reserved_blocks(num_tokens, final_len)
        if not (self.fits(num_tokens, width=width, final_len=final_len)
                and self.can_admit(num_tokens, num_tokens, width=width, final_len=final_len)):
            raise ValueError(f"no room for {width} free regions of {need} blocks (largest free: "
                             f"{self.buddy.largest_free_block()}); check can_admit first")
        offsets = [self.buddy.allocate(need) for _ in range(width)]
        self._family[seq_id] = seq_id
        self._members[seq_id] = 1
        self._spares[seq_id] = offsets[1:]
        return self._place(seq_id, offsets[0], final_len)

    def cache_blocks(self, seq_id: int, token_ids: list[int], cache_salt=None, keys=None) -> None:
        """Nothing to do: no prefix cache."""

    def free(self, seq_id: int) -> None:
        """Drops the sequence's region: to its group's spares while the group lives, else to the buddy."""
        if not self.rows.has_seq(seq_id):
            raise KeyError(f"cannot free sequence {seq_id}: it holds no region (unknown or already freed)")
        row = self.rows.row_of(seq_id)
        root = self._family[seq_id]
        waiting = self._waiting_forks[root]
        if int(self.base[row]) == 0:  # a fork still waiting for a region
            waiting[:] = [(c, p) for c, p in waiting if c != seq_id]
        elif waiting:  # (a child of this very sequence gets its tokens in place: nothing to copy)
            child, parent = waiting.pop(0)
            self._give_region(child, parent, int(self.base[row]) - 1)
        else:
            self._spares[root].append(int(self.base[row]) - 1)
        self.rows.pop(seq_id)
        del self._family[seq_id]
        self.rows.clear(row)
        self.base[row] = 0
        self._members[root] -= 1
        if self._members[root] == 0:  # the group is done: its spares and pending copies go
            for offset in self._spares.pop(root):
                self.buddy.free(offset)
            del self._members[root], self._waiting_forks[root], self._copies[root]

    def fork(self, parent_id: int, child_id: int, num_blocks: int | None = None) -> int:
        """Gives `child_id` a spare region of the parent's group holding a copy of the parent's first
        `num_blocks` blocks (default all its tokens), or, with no spare, the next region a sibling
        frees; returns its row."""
        if self.rows.has_seq(child_id):
            raise ValueError(f"cannot fork onto sequence {child_id}: it already holds a region")
        parent_row = self.rows.row_of(parent_id)
        root = self._family[parent_id]
        self._family[child_id] = root
        self._members[root] += 1
        row = self._take_row(child_id)
        self.final_len[row] = self.final_len[parent_row]
        num_tokens = self.rows.num_tokens
        num_tokens[row] = num_tokens[parent_row] if num_blocks is None else num_blocks * self.block_size
        if self._spares[root]:
            self._give_region(child_id, parent_id, self._spares[root].pop())
        else:
            self._waiting_forks[root].append((child_id, parent_id))
        return row

    # ------------------------------------------------------------------ append (every step)

    def append_slots(self, rows: np.ndarray, counts: np.ndarray | None = None, *, may_share: bool = True
                     ) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Gives row `rows[i]` the next `counts[i]` slots (default one) of its region: slot = base * B
        + position. Never fails (and nothing is ever shared: `may_share` is moot). The copy pairs
        returned are the forks' copies issued since the last call (none without forks)."""
        copies = [pair for pairs in self._copies.values() for pair in pairs]
        for pairs in self._copies.values():
            pairs.clear()
        bs, store = self.block_size, self.rows
        pos = store.num_tokens[rows]
        end = pos + (1 if counts is None else counts)
        base = self.base[rows]
        if (base == 0).any():  # only inside one beam step may a fork lack a region
            raise RuntimeError("a forked sequence has no region: its group forked more beams than it frees")
        if (end > self.region_blocks[rows] * bs).any():
            # The engine finishes a sequence at final_len, which every policy reserves: a caller bug.
            raise RuntimeError("a sequence outgrew its contiguous reservation")
        have = store.num_table_blocks[rows]
        used = (end + bs - 1) // bs
        for i in (used > have).nonzero()[0].tolist():  # rows that open blocks of their region
            row, first = int(rows[i]), int(base[i])
            store.block_tables[row, have[i]: used[i]] = np.arange(first + have[i], first + used[i])
            store.num_table_blocks[row] = used[i]
        store.num_tokens[rows] = end
        if counts is None:
            return (base * bs + pos).astype(np.int32), copies
        starts = np.cumsum(counts) - counts
        slots = np.arange(int(counts.sum())) + np.repeat(base * bs + pos - starts, counts)
        return slots.astype(np.int32), copies

    def blocks_needed(self, rows: list[int], counts: list[int] | None = None) -> int:
        """0: appending never takes a block (each region was reserved whole at admission)."""
        return 0

    def append_row(self, row: int, count: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """`append_slots` for one row and `count` tokens."""
        return self.append_slots(np.array([row], np.int64), np.array([count], np.int64))

    def decode_cursor(self, rows: list[int]) -> AppendCursor:
        """The generic cursor over `append_slots` (appending never fails here)."""
        return AppendCursor(self, rows)

    # ------------------------------------------------------------------ accounting

    def usage_breakdown(self, next_request: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
        """(token_states, reserved, internal, external) slots now; the rest of the slots are free
        (paper Fig. 2, `jpaged.paper.kv_usage`).

        Per region of a sequence that writes K/V for its first final_len - 1 positions (the last
        sampled token is never fed back): token_states = slots written; reserved = slots it will
        still write; internal = the rest of the region (policy over-reservation, block and buddy
        power-of-two rounding). external = free slots in buddy blocks too small for the next
        request's region, `next_request` = (tokens, final_len) of the head of the waiting queue;
        0 when nothing waits. A group's spare regions count as reserved: its future forks will
        fill them.
        """
        bs = self.block_size
        rows = self.rows.resident_rows()
        num_tokens = self.rows.num_tokens[rows]
        tokens = int(num_tokens.sum())
        spare = self._spare_blocks() * bs
        will = int(np.maximum(self.final_len[rows] - 1, num_tokens).sum()) + spare
        region = int(self.region_blocks[rows].sum()) * bs + spare
        external = 0
        if next_request is not None:
            need = self.reserved_blocks(*next_request)
            external = self.buddy.external_fragmentation(need) * bs
        return tokens, will - tokens, region - will, external

    # ------------------------------------------------------------------ internals

    def _place(self, seq_id: int, offset: int, final_len: int) -> int:
        """A row for `seq_id` in the region at buddy `offset`, holding no tokens yet."""
        root = self._family[seq_id]
        self._waiting_forks.setdefault(root, [])
        self._copies.setdefault(root, [])
        row = self._take_row(seq_id)
        self.base[row] = offset + 1
        self.region_blocks[row] = self.buddy.allocated_size(offset)
        self.final_len[row] = final_len
        return row

    def _give_region(self, child_id: int, parent_id: int, offset: int) -> None:
        """Moves a forked child into the region at `offset` and queues copies of the parent's blocks."""
        store = self.rows
        row, parent_row = store.row_of(child_id), store.row_of(parent_id)
        n = store.blocks_for(int(store.num_tokens[row]))  # the child's share of the parent's blocks
        self.base[row] = offset + 1
        self.region_blocks[row] = self.buddy.allocated_size(offset)
        store.block_tables[row, :n] = np.arange(offset + 1, offset + 1 + n)
        store.num_table_blocks[row] = n
        src = store.block_tables[parent_row, :n].tolist()
        self._copies[self._family[child_id]].extend(
            (s, d) for s, d in zip(src, range(offset + 1, offset + 1 + n)) if s != d)

    def _take_row(self, seq_id: int) -> int:
        """A row for `seq_id`; the regions' arrays grow with the store."""
        row = self.rows.take(seq_id)
        extra = self.rows.num_rows - len(self.base)
        if extra:
            self.base, self.region_blocks, self.final_len = (
                np.concatenate([a, np.zeros(extra, a.dtype)]) for a in (self.base, self.region_blocks, self.final_len))
        return row

    def _spare_blocks(self) -> int:
        """Blocks in the spare regions of every live group."""
        return sum(self.buddy.allocated_size(o) for offsets in self._spares.values() for o in offsets)
