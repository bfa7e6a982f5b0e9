"""Iteration-level FCFS scheduling with all-or-nothing preemption (paper §4.5) -> StepPlan.

Each step is either a prefill batch (admit waiting groups, FCFS, while blocks, `max_num_seqs` and
`max_num_batched_tokens` allow) or a decode batch (one token for every running sequence). When a
decode step cannot get slots, the latest-arrived groups are preempted first, whole, by swapping
their blocks to host memory or by freeing them for recomputation. While preempted groups wait, no
new group is admitted: swapped groups come back first, and recompute victims go back to the front
of the waiting queue. Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging

import numpy as np

from jpaged.block_manager import AllocStatus, BlockManager
from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.sequence import Sequence, SequenceGroup, SequenceStatus
from jpaged.step_plan import StepPlan, bucket, pairs_array

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class SchedulerOutput:
    """One scheduling decision: the plan to execute and what happened to groups on the way."""

    plan: StepPlan
    seqs: list[Sequence]  # the batch's sequences, row by row (read-only: the scheduler may reuse it)
    groups: list[SequenceGroup]  # groups with a sequence in the batch, in batch order
    rejected: list[tuple[SequenceGroup, str]]  # groups that can never run, with the reason
    num_preempted: int  # groups preempted in this step


class Scheduler:
    """FCFS waiting queue, running list and swapped queue over one block manager."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, block_manager: BlockManager | None = None):
        self.config = config
        self.block_size = cache.block_size
        self.block_manager = block_manager or BlockManager(
            cache.num_blocks, cache.block_size, cache.num_host_blocks, config.max_model_len,
            watermark=cache.watermark, max_seqs=config.max_num_seqs,
            enable_prefix_caching=cache.enable_prefix_caching)
        self.prefix_caching = cache.enable_prefix_caching
        self.num_prompt_tokens = 0  # tokens admitted for prefill (prompts, and recomputed outputs)
        self.num_cached_tokens = 0  # of those, tokens served from the prefix cache
        self.waiting: collections.deque[SequenceGroup] = collections.deque()
        self.running: list[SequenceGroup] = []  # sorted by arrival_order
        self.swapped: collections.deque[SequenceGroup] = collections.deque()
        self.num_preemptions = 0
        # The running sequences and their block-table rows, rebuilt only when the running set
        # changes (admission, preemption, swap-in, fork, finish), not every decode step.
        self._batch: tuple[list[Sequence], np.ndarray] | None = None
        self._touched: list[SequenceGroup] = []  # groups that freed a sequence since remove_finished
        self._arange = np.arange(config.max_num_seqs + 1, dtype=np.int32)  # reused by decode plans

    # ------------------------------------------------------------------ queue management

    def add(self, group: SequenceGroup) -> None:
        """Queues a new request."""
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        """True while any group waits, runs or is swapped out."""
        return bool(self.waiting or self.running or self.swapped)

    def abort(self, group: SequenceGroup) -> None:
        """Removes a group from whichever queue holds it and frees its blocks."""
        for queue in (self.waiting, self.swapped):
            if group in queue:
                queue.remove(group)
        if group in self.running:
            self.running.remove(group)
        for seq in group.seqs:
            self.free_seq(seq, group)

    def free_seq(self, seq: Sequence, group: SequenceGroup) -> None:
        """Frees a sequence's blocks if it holds any (finished or dropped beams).

        With prefix caching its full blocks stay cached for later requests with the same prefix.
        """
        self._release(seq, group)
        self._batch = None
        self._touched.append(group)

    def _release(self, seq: Sequence, group: SequenceGroup) -> None:
        bm = self.block_manager
        if bm.has_seq(seq.seq_id):
            if self.prefix_caching:
                bm.cache_blocks(seq.seq_id, seq.token_ids, group.cache_salt, seq.block_keys)
            bm.free(seq.seq_id)
        elif bm.is_swapped(seq.seq_id):
            bm.free(seq.seq_id)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """Shares the parent's blocks with a new sequence of the same group (count + 1)."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        self._batch = None

    def remove_finished(self) -> None:
        """Drops finished groups from the running list (after sequences finished)."""
        if self._touched:
            for group in {id(g): g for g in self._touched}.values():
                if group.is_finished and group in self.running:
                    self.running.remove(group)
            self._touched.clear()

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        """Decides the next step: a prefill batch if a waiting group can be admitted, else decode."""
        rejected: list[tuple[SequenceGroup, str]] = []
        if not self.swapped:
            prefill = self._schedule_prefill(rejected)
            if prefill is not None:
                return prefill
        return self._schedule_decode(rejected)

    def _schedule_prefill(self, rejected) -> SchedulerOutput | None:
        bm = self.block_manager
        cfg = self.config
        num_running_seqs = len(self._running_batch()[0])
        admitted: list[SequenceGroup] = []
        starts: dict[int, int] = {}  # seq id -> tokens already cached (the prefill computes the rest)
        num_tokens = 0
        while self.waiting:
            group = self.waiting[0]
            seqs = group.live_seqs(SequenceStatus.WAITING)
            group_tokens = sum(len(s) for s in seqs)  # each sequence is prefilled whole (less cache hits)
            final_len = group.prompt_len + group.sampling_params.max_tokens
            prefix = ({"token_ids": seqs[0].token_ids, "cache_salt": group.cache_salt, "keys": seqs[0].block_keys}
                      if self.prefix_caching else {})
            # A manager that reserves memory per sequence (Orca's contiguous regions) must find room
            # now for the sequences a fresh group forks into after its prompt; paged blocks share it.
            forks = (group.sampling_params.n - len(seqs)
                     if len(group.seqs) == 1 and getattr(bm, "reserves_per_sequence", False) else 0)
            status = bm.can_allocate(max(len(s) for s in seqs), num_seqs=len(seqs) + forks, final_len=final_len,
                                     **prefix)
            if status is AllocStatus.NEVER:
                self.waiting.popleft()
                rejected.append((group, f"needs {sum(bm.blocks_for(len(s)) for s in seqs)} KV blocks, more than the "
                                        f"pool can ever give ({bm.num_usable_blocks} blocks, watermark included)"))
                continue
            # The token budget binds only after the first group: a group recomputing its outputs
            # (or several samples of one) may need more than the budget, and must still progress.
            if (status is AllocStatus.LATER
                    or (admitted and num_tokens + group_tokens > cfg.max_num_batched_tokens)
                    or num_running_seqs + len(seqs) > cfg.max_num_seqs):
                break
            self.waiting.popleft()
            for seq in seqs:
                if self.prefix_caching:
                    _, starts[seq.seq_id] = bm.allocate_with_prefix(seq.seq_id, seq.token_ids, group.cache_salt,
                                                                    seq.block_keys)
                    # The prompt's full blocks are written by this step (each layer writes before
                    # it attends), so later admissions, even in this batch, may share them.
                    bm.cache_blocks(seq.seq_id, seq.token_ids, group.cache_salt, seq.block_keys)
                elif forks > 0:
                    bm.allocate(seq.seq_id, len(seq), final_len=final_len, num_forks=forks)
                    starts[seq.seq_id] = 0
                else:
                    bm.allocate(seq.seq_id, len(seq), final_len=final_len)
                    starts[seq.seq_id] = 0
                seq.status = SequenceStatus.RUNNING
                self.num_prompt_tokens += len(seq)
                self.num_cached_tokens += starts[seq.seq_id]
            num_tokens += group_tokens
            num_running_seqs += len(seqs)
            admitted.append(group)
            bisect.insort(self.running, group, key=lambda g: g.arrival_order)
        if not admitted:
            return None
        self._batch = None
        plan, seqs = self._prefill_plan(admitted, starts)
        return SchedulerOutput(plan, seqs, admitted, rejected, 0)

    def _schedule_decode(self, rejected) -> SchedulerOutput:
        bm = self.block_manager
        num_preempted = 0
        swap_out: list[tuple[int, int]] = []
        seqs, rows = self._running_batch()
        while (appended := bm.append_slots(rows)) is None:
            victim = self.running.pop()  # the latest arrival
            self._batch = None
            if not self.running and bm.blocks_needed_to_append(self._running_batch()[1]) > bm.num_free_blocks:
                self.running.append(victim)
                rejected.append((victim, "its sequences outgrew the whole KV pool"))
                self.abort(victim)
            else:
                swap_out += self._preempt(victim)
                num_preempted += 1
            seqs, rows = self._running_batch()
        slots, copy_pairs = appended
        swap_in: list[tuple[int, int]] = []
        if num_preempted == 0 and self.swapped:
            swap_in, in_seqs = self._swap_in()
            if in_seqs:
                # Rows of a plan need not follow arrival order; the running list does.
                in_rows = np.array([bm.row_of(s.seq_id) for s in in_seqs], dtype=np.int64)
                in_slots, in_pairs = bm.append_slots(in_rows)  # room was checked by can_swap_in
                seqs, rows = seqs + in_seqs, np.concatenate([rows, in_rows])
                slots, copy_pairs = np.concatenate([slots, in_slots]), copy_pairs + in_pairs
        plan = self._decode_plan(seqs, rows, slots)
        plan.copy_pairs = pairs_array(copy_pairs)
        plan.swap_in_pairs = pairs_array(swap_in)
        plan.swap_out_pairs = pairs_array(swap_out)
        self.num_preemptions += num_preempted
        return SchedulerOutput(plan, seqs, self.running, rejected, num_preempted)

    def _preempt(self, group: SequenceGroup) -> list[tuple[int, int]]:
        """Evicts a whole group: swap when configured and room allows, else recompute."""
        bm = self.block_manager
        seq_ids = [s.seq_id for s in group.live_seqs(SequenceStatus.RUNNING)]
        if self.config.preemption_mode == "swap" and bm.can_swap_out(seq_ids):
            pairs = bm.swap_out(seq_ids)
            for seq in group.live_seqs(SequenceStatus.RUNNING):
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            return pairs
        for seq in group.live_seqs(SequenceStatus.RUNNING):
            self._release(seq, group)
            seq.status = SequenceStatus.WAITING
        # Back to the front: FCFS by arrival, ahead of every request that arrived later.
        self.waiting.appendleft(group)
        return []

    def _swap_in(self) -> tuple[list[tuple[int, int]], list[Sequence]]:
        """Brings swapped groups back, FIFO, while room allows; returns copy pairs and their sequences."""
        bm = self.block_manager
        pairs: list[tuple[int, int]] = []
        seqs: list[Sequence] = []
        num_seqs = len(self._running_batch()[0])
        num_appends = 0  # new blocks the groups swapped in so far may take for this step's token
        while self.swapped:
            group = self.swapped[0]
            group_seqs = group.live_seqs(SequenceStatus.SWAPPED)
            seq_ids = [s.seq_id for s in group_seqs]
            # Room for the blocks plus one new block per sequence (this group's and earlier ones')
            # for this step's token.
            num_appends += len(seq_ids)
            if num_seqs + len(seq_ids) > self.config.max_num_seqs or not bm.can_swap_in(seq_ids, num_appends):
                break
            self.swapped.popleft()
            self._batch = None
            pairs += bm.swap_in(seq_ids)
            for seq in group_seqs:
                seq.status = SequenceStatus.RUNNING
            seqs += group_seqs
            num_seqs += len(seq_ids)
            bisect.insort(self.running, group, key=lambda g: g.arrival_order)
        return pairs, seqs

    # ------------------------------------------------------------------ plans

    def _running_batch(self) -> tuple[list[Sequence], np.ndarray]:
        """Running sequences in FCFS group order and their block-table rows i64[n] (cached)."""
        if self._batch is None:
            running = SequenceStatus.RUNNING
            seqs = [s for g in self.running for s in g.seqs if s.status is running]
            row_of = self.block_manager.row_of
            self._batch = seqs, np.fromiter((row_of(s.seq_id) for s in seqs), dtype=np.int64, count=len(seqs))
        return self._batch

    def _table_width(self, rows: np.ndarray) -> int:
        bm = self.block_manager
        longest = int(bm.num_table_blocks[rows].max()) if len(rows) else 1
        return min(bucket(longest), bm.max_blocks_per_seq)

    def _decode_plan(self, seqs: list[Sequence], rows: np.ndarray, slots: np.ndarray) -> StepPlan:
        bm = self.block_manager
        n = len(seqs)
        size = bucket(n)
        # One allocation for the five per-row vectors (this runs every decode step).
        buffer = np.zeros(5 * size + 1, np.int32)
        token_ids, context_lens, slot_mapping, logits_indices, query_start_loc = (
            buffer[:size], buffer[size:2 * size], buffer[2 * size:3 * size], buffer[3 * size:4 * size],
            buffer[4 * size:])
        if n >= len(self._arange):  # forks (n > 1, beams) can outgrow max_num_seqs
            self._arange = np.arange(2 * n + 1, dtype=np.int32)
        token_ids[:n] = [s.token_ids[-1] for s in seqs]
        lengths = bm.num_tokens[rows]  # tokens with a slot, this step's included
        context_lens[:n] = lengths
        positions = context_lens - 1
        positions[n:] = 0
        slot_mapping[:n] = slots
        logits_indices[:n] = self._arange[:n]
        query_start_loc[: n + 1] = self._arange[: n + 1]
        query_start_loc[n + 1:] = n
        longest = int(lengths.max()) if n else 1
        width = min(bucket(-(-longest // bm.block_size)), bm.max_blocks_per_seq)
        tables = np.zeros((size, width), np.int32)
        tables[:n] = bm.block_tables[rows, :width]
        return StepPlan(False, n, n, token_ids, positions, slot_mapping, query_start_loc, context_lens,
                        tables, logits_indices)

    def _prefill_plan(self, groups: list[SequenceGroup], cached: dict[int, int]) -> tuple[StepPlan, list[Sequence]]:
        bm = self.block_manager
        seqs = [s for g in groups for s in g.seqs if s.status is SequenceStatus.RUNNING]
        starts = [cached[s.seq_id] for s in seqs]
        rows = np.array([bm.row_of(s.seq_id) for s in seqs], dtype=np.int64)
        lens = np.array([len(s) for s in seqs], dtype=np.int32)
        q_lens = lens - np.array(starts, dtype=np.int32)
        n, total = len(seqs), int(q_lens.sum())
        size_s, size_t = bucket(n), bucket(total, minimum=16)
        token_ids = np.zeros(size_t, np.int32)
        positions = np.zeros(size_t, np.int32)
        slot_mapping = np.zeros(size_t, np.int32)
        query_start_loc = np.full(size_s + 1, total, np.int32)
        query_start_loc[: n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
        for i, (seq, row, start) in enumerate(zip(seqs, rows.tolist(), starts)):
            lo, hi = query_start_loc[i], query_start_loc[i + 1]
            token_ids[lo:hi] = seq.token_ids[start:]
            positions[lo:hi] = np.arange(start, len(seq))
            slot_mapping[lo:hi] = bm.slot_mapping(row, start, len(seq))
        context_lens = np.zeros(size_s, np.int32)
        context_lens[:n] = lens
        tables = np.zeros((size_s, self._table_width(rows)), np.int32)
        tables[:n] = bm.block_tables[rows, : tables.shape[1]]
        logits_indices = np.zeros(size_s, np.int32)
        logits_indices[:n] = query_start_loc[1: n + 1] - 1
        return StepPlan(True, n, total, token_ids, positions, slot_mapping, query_start_loc, context_lens,
                        tables, logits_indices), seqs
