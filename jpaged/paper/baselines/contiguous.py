"""Orca's contiguous KV cache behind the paged block manager's interface (paper §6.1).

Each sequence gets one contiguous region, placed by a buddy allocator, sized by a reservation
policy (Oracle: prompt + true output; Pow2: output rounded up to a power of two; Max: the maximum
sequence length). The buddy works in units of one KV block, so every region is block-aligned and
at least one block, and a region at buddy offset `o` is the consecutive block ids o+1, o+2, ...
(block 0 stays the reserved padding target). Block tables therefore stay valid, and the same
scheduler, StepPlans and executors (simulated or real) serve Orca and vLLM alike.

A reservation covers the sequence's final length, so appending never fails and Orca never
preempts; there is no swap space.

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

from jpaged.core.decode_cursor import AppendCursor
from jpaged.core.kv_manager import AllocStatus
from jpaged.paper.baselines.buddy import BuddyAllocator, Policy, order_of, reservation


class ContiguousBlockManager:
    """One buddy-placed contiguous region per sequence, reserved ahead by an Orca policy
    (implements `kv_manager.KVCacheManager`)."""

    prefix_cache = None  # no prefix sharing in the contiguous baselines
    num_host_blocks = 0  # no swap space: Orca never preempts
    num_free_host_blocks = 0
    watermark_blocks = 0  # nothing grows past its reservation, so no admission headroom is needed

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
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.buddy = BuddyAllocator(num_blocks - 1)  # unit = one block; unit u is block u + 1
        rows = max(1, max_seqs) + 1  # row 0 is reserved (see kv_manager.KVCacheManager)
        self.block_tables = np.zeros((rows, self.max_blocks_per_seq), dtype=np.int32)  # [rows, M]
        self.num_table_blocks = np.zeros(rows, dtype=np.int32)  # [rows] blocks holding tokens
        self.num_tokens = np.zeros(rows, dtype=np.int32)  # [rows] tokens that have a slot
        self.base = np.zeros(rows, dtype=np.int64)  # [rows] first block id of the row's region
        self.region_blocks = np.zeros(rows, dtype=np.int64)  # [rows] blocks in the region (a power of two)
        self.final_len = np.zeros(rows, dtype=np.int64)  # [rows] prompt + max_tokens of the sequence
        self._free_rows = list(range(rows - 1, 0, -1))
        self._row_of: dict[int, int] = {}  # seq id -> row
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

    def usage(self) -> float:
        """Fraction of usable blocks inside allocated regions."""
        return 1.0 - self.buddy.free_units / self.num_usable_blocks

    def has_seq(self, seq_id: int) -> bool:
        """True when `seq_id` holds a region."""
        return seq_id in self._row_of

    def is_swapped(self, seq_id: int) -> bool:
        """Always False: the contiguous baselines have no swap space."""
        return False

    def num_slots(self, seq_id: int) -> int:
        """Tokens of `seq_id` that have a slot in its device row (0 when it holds none)."""
        row = self._row_of.get(seq_id)
        return 0 if row is None else int(self.num_tokens[row])

    def row_of(self, seq_id: int) -> int:
        """The block-table row of a resident sequence."""
        try:
            return self._row_of[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} holds no region") from None

    def rows_of(self, seq_ids: list[int]) -> np.ndarray:
        """i64[n] block-table rows of resident sequences (KeyError names the first that is not)."""
        row_of = self._row_of
        try:
            return np.array([row_of[s] for s in seq_ids], dtype=np.int64)
        except KeyError as exc:
            raise KeyError(f"sequence {exc.args[0]} holds no region") from None

    def block_table(self, seq_id: int) -> np.ndarray:
        """A copy of the block ids holding the sequence's tokens, in logical order."""
        row = self.row_of(seq_id)
        return self.block_tables[row, : self.num_table_blocks[row]].copy()

    def region(self, seq_id: int) -> tuple[int, int]:
        """(first block id, number of blocks) of the sequence's whole reserved region."""
        row = self.row_of(seq_id)
        return int(self.base[row]), int(self.region_blocks[row])

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def reserved_blocks(self, num_tokens: int, final_len: int) -> int:
        """Blocks the policy asks the buddy for: the token reservation rounded up to whole blocks.

        `num_tokens` are the tokens present at admission (the prompt); the rest of `final_len`
        is the output to reserve for.
        """
        if final_len is None or final_len <= num_tokens:
            raise ValueError(f"final_len must exceed num_tokens ({num_tokens}) for a contiguous "
                             f"reservation, got {final_len}")
        tokens = reservation(self.policy, num_tokens, final_len - num_tokens, self.max_model_len)
        return self.blocks_for(tokens)

    # ------------------------------------------------------------------ admission

    def match_prefix(self, token_ids: list[int], cache_salt=None, keys=None) -> list[int]:
        """Always empty: the contiguous baselines share no prefix."""
        return []

    def can_admit(self, num_tokens: int, num_scheduled: int, hits: list[int] = (), *, width: int = 1,
                  final_len: int | None = None, headroom: int | None = None, extra_blocks: int = 0) -> AllocStatus:
        """Whether `width` regions for sequences of `num_tokens` tokens growing to `final_len` fit now.

        The whole reservation is taken at admission, so `num_scheduled`, `headroom` and
        `extra_blocks` do not matter. A free buddy block of order o holds 2^(o - k) regions of
        order k, so the count is exact.
        """
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        k = order_of(self.reserved_blocks(num_tokens, final_len))
        if k > self.buddy.max_order or self.buddy.num_units >> k < width:
            return AllocStatus.NEVER
        if width == 1:  # the common case, O(log n)
            return AllocStatus.OK if self.buddy.can_allocate(1 << k) else AllocStatus.LATER
        fits = sum(units >> k for _, units in self.buddy.free_blocks())
        return AllocStatus.OK if fits >= width else AllocStatus.LATER

    def admit(self, seq_id: int, hits: list[int] = (), *, width: int = 1, final_len: int | None = None,
              num_tokens: int | None = None) -> int:
        """Reserves a region for a new sequence of `num_tokens` tokens growing to `final_len`, plus
        `width - 1` spare regions for the sequences its group forks into; returns its row. Its
        tokens get slots from `append_slots`."""
        if seq_id in self._row_of:
            raise ValueError(f"sequence {seq_id} already holds a region")
        need = self.reserved_blocks(num_tokens, final_len)
        if self.can_admit(num_tokens, num_tokens, width=width, final_len=final_len) is not AllocStatus.OK:
            raise ValueError(f"no room for {width} free regions of {need} blocks (largest free: "
                             f"{self.buddy.largest_free_block()}); check can_admit first")
        offsets = [self.buddy.allocate(need) for _ in range(width)]
        self._family[seq_id] = seq_id
        self._members[seq_id] = 1
        self._spares[seq_id] = offsets[1:]
        return self._place(seq_id, offsets[0], final_len)

    def allocate(self, seq_id: int, num_tokens: int, final_len: int, width: int = 1) -> int:
        """`admit` plus slots for the first `num_tokens` tokens; returns the row."""
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        row = self.admit(seq_id, width=width, final_len=final_len, num_tokens=num_tokens)
        self.append_slots(np.array([row]), np.array([num_tokens]))
        return row

    def cache_blocks(self, seq_id: int, token_ids: list[int], cache_salt=None, keys=None) -> None:
        """Nothing to do: no prefix cache."""

    def free(self, seq_id: int) -> None:
        """Drops the sequence's region: to its group's spares while the group lives, else to the buddy."""
        if seq_id not in self._row_of:
            raise KeyError(f"cannot free sequence {seq_id}: it holds no region (unknown or already freed)")
        row = self._row_of[seq_id]
        root = self._family[seq_id]
        waiting = self._waiting_forks[root]
        if int(self.base[row]) == 0:  # a fork still waiting for a region
            waiting[:] = [(c, p) for c, p in waiting if c != seq_id]
        elif waiting:  # (a child of this very sequence gets its tokens in place: nothing to copy)
            child, parent = waiting.pop(0)
            self._give_region(child, parent, int(self.base[row]) - 1)
        else:
            self._spares[root].append(int(self.base[row]) - 1)
        del self._row_of[seq_id], self._family[seq_id]
        self._clear_row(row)
        self._members[root] -= 1
        if self._members[root] == 0:  # the group is done: its spares and pending copies go
            for offset in self._spares.pop(root):
                self.buddy.free(offset)
            del self._members[root], self._waiting_forks[root], self._copies[root]

    def fork(self, parent_id: int, child_id: int, num_blocks: int | None = None) -> int:
        """Gives `child_id` a spare region of the parent's group holding a copy of the parent's first
        `num_blocks` blocks (default all its tokens), or, with no spare, the next region a sibling
        frees; returns its row."""
        if child_id in self._row_of:
            raise ValueError(f"cannot fork onto sequence {child_id}: it already holds a region")
        parent_row = self.row_of(parent_id)
        root = self._family[parent_id]
        self._family[child_id] = root
        self._members[root] += 1
        row = self._take_row(child_id)
        self.final_len[row] = self.final_len[parent_row]
        self.num_tokens[row] = (self.num_tokens[parent_row] if num_blocks is None
                                else num_blocks * self.block_size)
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
        bs = self.block_size
        pos = self.num_tokens[rows]
        end = pos + (1 if counts is None else counts)
        base = self.base[rows]
        if (base == 0).any():  # only inside one beam step may a fork lack a region
            raise RuntimeError("a forked sequence has no region: its group forked more beams than it frees")
        if (end > self.region_blocks[rows] * bs).any():
            # The engine finishes a sequence at final_len, which every policy reserves: a caller bug.
            raise RuntimeError("a sequence outgrew its contiguous reservation")
        have = self.num_table_blocks[rows]
        used = (end + bs - 1) // bs
        for i in (used > have).nonzero()[0].tolist():  # rows that open blocks of their region
            row, first = int(rows[i]), int(base[i])
            self.block_tables[row, have[i]: used[i]] = np.arange(first + have[i], first + used[i])
            self.num_table_blocks[row] = used[i]
        self.num_tokens[rows] = end
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

    # ------------------------------------------------------------------ swap (none)

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        """Always False: with no swap space the scheduler recomputes if it ever must preempt."""
        return False

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Never called: `can_swap_out` is always False."""
        raise ValueError("cannot swap out: the contiguous baselines have no swap space")

    def swapped_blocks(self, seq_ids: list[int]) -> int:
        """0: nothing is ever swapped out."""
        return 0

    def can_swap_in(self, seq_ids: list[int], extra_blocks: int = 0, headroom: int | None = None) -> bool:
        """Always False: nothing is ever swapped out."""
        return False

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Never called: nothing is ever swapped out."""
        raise ValueError("cannot swap in: the contiguous baselines have no swap space")

    # ------------------------------------------------------------------ accounting

    def usage_breakdown(self, final_lens: dict[int, int] | None = None,
                        next_request: tuple[int, int] | None = None) -> tuple[int, int, int, int]:
        """(token_states, reserved, internal, external) slots now; the rest of the slots are free.

        Per region of a sequence that writes K/V for its first final_len - 1 positions (the last
        sampled token is never fed back): token_states = slots written; reserved = slots it will
        still write; internal = the rest of the region (policy over-reservation, block and buddy
        power-of-two rounding). external = free slots in buddy blocks too small for the next
        request's region, `next_request` = (tokens, final_len) of the head of the waiting queue;
        0 when nothing waits. `final_lens` is unused: each region records its own. A group's spare
        regions count as reserved: its future forks will fill them.
        """
        bs = self.block_size
        rows = np.fromiter(self._row_of.values(), dtype=np.int64, count=len(self._row_of))
        tokens = int(self.num_tokens[rows].sum())
        spare = self._spare_blocks() * bs
        will = int(np.maximum(self.final_len[rows] - 1, self.num_tokens[rows]).sum()) + spare
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
        row, parent_row = self._row_of[child_id], self._row_of[parent_id]
        n = self.blocks_for(int(self.num_tokens[row]))  # the child's share of the parent's blocks
        self.base[row] = offset + 1
        self.region_blocks[row] = self.buddy.allocated_size(offset)
        self.block_tables[row, :n] = np.arange(offset + 1, offset + 1 + n)
        self.num_table_blocks[row] = n
        src = self.block_tables[parent_row, :n].tolist()
        self._copies[self._family[child_id]].extend(
            (s, d) for s, d in zip(src, range(offset + 1, offset + 1 + n)) if s != d)

    def _take_row(self, seq_id: int) -> int:
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        return row

    def _clear_row(self, row: int) -> None:
        self.block_tables[row, : self.num_table_blocks[row]] = 0
        self.num_table_blocks[row] = 0
        self.num_tokens[row] = 0
        self.base[row] = 0
        self._free_rows.append(row)

    def _spare_blocks(self) -> int:
        """Blocks in the spare regions of every live group."""
        return sum(self.buddy.allocated_size(o) for offsets in self._spares.values() for o in offsets)

    def _grow_rows(self) -> None:
        old = len(self.num_tokens)
        self.block_tables = np.concatenate([self.block_tables, np.zeros_like(self.block_tables)])
        for name in ("num_table_blocks", "num_tokens", "base", "region_blocks", "final_len"):
            array = getattr(self, name)
            setattr(self, name, np.concatenate([array, np.zeros_like(array)]))
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))
