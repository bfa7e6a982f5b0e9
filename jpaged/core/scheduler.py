"""Iteration-level scheduling by token budget: the paper's vLLM and chunked prefill as two settings.

Every step has a token budget (`max_num_batched_tokens`) and a sequence budget (`max_num_seqs`).
A sequence's computed tokens are the slots its block-table row holds (`RowStore.num_slots`:
taking slots is scheduling tokens); a step gives each scheduled sequence some new tokens,
always the last ones of its context (a prompt chunk, or the one token sampled last), so one
StepPlan describes any mix. Three passes fill a step:

1. running groups: every decoding sequence gets its token (the budget reserves them first), then
   partly prefilled groups get prompt chunks from what is left; when blocks run out, the
   latest-arrived group is preempted whole (swap or recompute), and a group that cannot continue
   even alone has outgrown the pool and is aborted with an error;
2. swapped groups come back, FIFO, while blocks allow (only if nothing was preempted);
3. waiting groups are admitted, FCFS, while the budgets and blocks allow, unless swapped groups wait.

`policy: paper` is the paper's vLLM (v0): admission comes first and a step that admits runs only
whole prompts (the token budget binds after its first group, so a long recompute still runs);
`policy: chunked` is vLLM v1 / Sarathi-Serve: decodes first, prompts chunked into what is left.
The memory manager is any `kv_manager.KVCacheManager`; what happens after a step (appending
tokens, forks, beams, stop checks, frees) lives in `jpaged.core.postprocess`. Pure Python + numpy.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import logging

import numpy as np

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.block_manager import BlockManager
from jpaged.core.decode_batch import DecodeBatch
from jpaged.core.kv_manager import KVCacheManager
from jpaged.core.plan_builder import PlanBuilder, batch_plan
from jpaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from jpaged.core.step_plan import StepPlan

logger = logging.getLogger(__name__)

_NO_LIMIT = 1 << 62


@dataclasses.dataclass
class SchedulerOutput:
    """One scheduling decision: the plan to execute and what happened to groups on the way."""

    plan: StepPlan
    admitted: list[SequenceGroup]  # groups scheduled for the first time in this step
    rejected: list[tuple[SequenceGroup, str]]  # groups that can never run, with the reason
    num_preempted: int  # groups preempted in this step
    kv_full: bool  # blocks ran out: a preemption, or a waiting group held back for lack of blocks
    # The running batch when its decodes lead the plan's sample rows (`SampleRows.num_batch_rows`):
    # the postprocessor records their sampled tokens in it as the next step's input ids.
    batch: DecodeBatch | None = None


class Scheduler:
    """FCFS waiting queue, running list and swapped queue over one KV memory manager."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, kv_manager: KVCacheManager | None = None):
        self.config = config
        self.block_manager: KVCacheManager = kv_manager or BlockManager(
            cache.num_blocks, cache.block_size, cache.num_host_blocks, config.max_model_len,
            watermark=cache.watermark, max_seqs=config.max_num_seqs,
            enable_prefix_caching=cache.enable_prefix_caching)
        self.prefix_caching = self.block_manager.prefix_cache is not None
        self.chunked = config.policy == "chunked"
        self.chunk_limit = config.long_prefill_token_threshold or _NO_LIMIT  # most new tokens per sequence per step
        self.num_prompt_tokens = 0  # prompt tokens admitted for prefill (prompts, and recomputed outputs)
        self.num_cached_tokens = 0  # of those, tokens served from the prefix cache
        self.waiting: collections.deque[SequenceGroup] = collections.deque()
        self.running: list[SequenceGroup] = []  # sorted by arrival_order
        self.swapped: collections.deque[SequenceGroup] = collections.deque()
        self.num_preemptions = 0
        # Running groups with a sequence still prefilling (chunks left) or not yet holding blocks
        # (a recomputed group's sequences join as they reach their shared prefix), by arrival.
        self._partial: list[SequenceGroup] = []
        # Decoding sequences of the other running groups and their rows, kept from step to step
        # and edited by events: groups that joined running or finished their prompts add their
        # sequences at the next step (`_batch_joins`), finished sequences leave it then
        # (`_batch_drops`), a preempted group's at once. A removal moves the last row into the
        # hole, which would reorder a forked group's rows (beam ranks follow their order): while
        # a running group has several sequences, a removal or a fork rebuilds it (None), in
        # running order, as a fresh batch would be.
        self._batch: DecodeBatch | None = None
        self._batch_joins: list[SequenceGroup] = []
        self._batch_drops: list[Sequence] = []
        self._touched: list[SequenceGroup] = []  # groups that freed a sequence since remove_finished
        # The max_num_seqs budget counts each running group at its width (n samples or beams), so
        # a fresh group's later forks and a beam step's churn never push a batch past the limit.
        self._num_running_seqs = 0
        self._num_multi_running = 0  # running groups that hold or will hold several sequences
        # Sequences of a recomputed group waiting to join it: seq id -> (earlier sequence it shares
        # a prefix with or None, shared tokens, shared blocks).
        self._joining: dict[int, tuple[Sequence | None, int, int]] = {}
        self._rejected: list[tuple[SequenceGroup, str]] = []
        self._held_back = False  # this step's admission stopped for lack of blocks
        # Admission of the queue's head is retried every step; while nothing it depends on has
        # changed since it was held back, the retry is skipped (`_nothing_to_admit`). The attempt's
        # group, block events, running sequences, prompt tokens it had left, tokens it asked for
        # and free blocks:
        self._held_back_at: tuple[SequenceGroup | None, int, int, int, int] = (None, -1, -1, -1, -1)
        self._held_back_free = 0  # (fewer free blocks cannot be enough)
        self._kv_events = 0  # frees, admissions, forks, swaps and cache inserts so far (see _admit)
        self._builder: PlanBuilder | None = None
        self._seq_ids = 0

    # ------------------------------------------------------------------ queue management

    def new_seq_id(self) -> int:
        """A fresh sequence id (requests and forks)."""
        self._seq_ids += 1
        return self._seq_ids

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
            self._leave_running(group)
            self._batch_drops += group.seqs
        for seq in group.seqs:
            self._release(seq)

    def free_seq(self, seq: Sequence) -> None:
        """Frees a finished (or dropped) sequence's blocks; with prefix caching they stay cached."""
        self._release(seq)
        self._batch_drops.append(seq)  # (the batch drops it at the next step: `_running_batch`)
        self._touched.append(seq.group)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """Shares the parent's blocks with a new sequence of the same group (count + 1)."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        self._kv_events += 1
        self._batch = None

    def remove_finished(self) -> None:
        """Drops finished groups from the running list (after sequences finished)."""
        if self._touched:
            for group in {id(g): g for g in self._touched}.values():
                if group.is_finished and group in self.running:
                    self._leave_running(group)
            self._touched.clear()

    def _release(self, seq: Sequence) -> None:
        self._joining.pop(seq.seq_id, None)
        self._kv_events += 1
        bm = self.block_manager
        if bm.rows.has_seq(seq.seq_id):
            if self.prefix_caching:
                bm.cache_blocks(seq.seq_id, seq.token_ids, seq.group.cache_salt, seq.block_keys)
            bm.free(seq.seq_id)
        elif bm.swap is not None and bm.swap.holds(seq.seq_id):
            bm.free(seq.seq_id)

    def _join_running(self, group: SequenceGroup) -> None:
        if not self.running or self.running[-1].arrival_order < group.arrival_order:
            self.running.append(group)  # the usual case: the latest arrival so far
        else:
            bisect.insort(self.running, group, key=lambda g: g.arrival_order)
        self._num_running_seqs += group.width
        self._num_multi_running += not group.is_single
        self._batch_joins.append(group)

    def _leave_running(self, group: SequenceGroup) -> None:
        """Takes a group off the running list (its sequences leave the batch by the caller)."""
        if self.running[-1] is group:  # (preemption takes the latest arrival)
            self.running.pop()
        else:
            self.running.remove(group)
        if group in self._partial:
            self._partial.remove(group)
        self._num_running_seqs -= group.width
        self._num_multi_running -= not group.is_single

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        """Decides the next step's batch (see the module docstring for the three passes)."""
        return self.schedule_step()

    def schedule_step(self) -> SchedulerOutput:
        """The three passes (policies that gate admission override `schedule` around this)."""
        self._held_back = False
        batch = self._batch
        if batch is not None and not (self._batch_joins or self._batch_drops or self._partial or self.swapped
                                      or self._num_multi_running):
            # The decode fast path: the running set is as the last step left it and admission
            # would stop at once, so the three passes come down to the batch's decode step.
            tokens_left = self.config.max_num_batched_tokens - (len(batch) if self.chunked else 0)
            if self._nothing_to_admit(tokens_left):
                decoded = batch.step()
                if decoded is not None:
                    return SchedulerOutput(batch_plan(batch, *decoded), [], [], 0, self._held_back, batch)
        self._builder = builder = PlanBuilder(self.block_manager)
        self._rejected = []
        budget = [self.config.max_num_batched_tokens]  # tokens left this step (a cell the passes update)
        admitted: list[SequenceGroup] = []
        preempted = 0
        if not self.chunked and not self.swapped:  # paper: prefill steps come first
            self._admit(builder, budget, admitted)
        if self.chunked or not admitted:
            preempted = self._schedule_running(builder, budget)
            if preempted == 0 and self.swapped:
                self._swap_in(builder, budget)
            if self.chunked and not self.swapped and preempted == 0:  # (vLLM v1: no admission after a preemption)
                self._admit(builder, budget, admitted)
        self.num_preemptions += preempted
        self._builder = None
        plan = builder.build(all_single=self._num_multi_running == 0)
        leading = builder.leading_batch if plan.sampling is not None and plan.sampling.num_batch_rows else None
        return SchedulerOutput(plan, admitted, self._rejected, preempted, preempted > 0 or self._held_back, leading)

    def _schedule_running(self, builder: PlanBuilder, budget: list[int]) -> int:
        """Pass 1: decode tokens of running groups, then chunks of partly prefilled ones. The
        decodes and the chunks get their slots all or nothing: while blocks are short, the
        latest-arrived group is preempted."""
        if self._num_multi_running:
            return self._schedule_running_forked(builder, budget)
        bm = self.block_manager
        num_preempted = 0
        while True:  # one sequence per group: the batch decodes through its cursor
            batch = self._running_batch()
            seqs = batch.seqs
            chunks = self._plan_partial(budget[0] - len(seqs)) if self._partial else []
            if not chunks:
                if not seqs:
                    return num_preempted
                decoded = batch.step()  # the steady state: (step arrays, block tables)
                if decoded is not None:
                    builder.add_decodes(batch, *decoded)
                    budget[0] -= len(seqs)
                    return num_preempted
            else:
                chunk_rows = [bm.rows.row_of(s.seq_id) for s, _ in chunks]
                chunk_counts = [c for _, c in chunks]
                if (batch.blocks_needed() if seqs else 0) + bm.blocks_needed(chunk_rows, chunk_counts) \
                        <= bm.num_free_blocks:
                    break
            num_preempted += self._preempt_latest()
        if seqs:  # (room was checked: neither can fail now)
            builder.add_decodes(batch, *batch.step())
            budget[0] -= len(seqs)
        for (seq, count), row in zip(chunks, chunk_rows):
            slots, copies = bm.append_row(row, count)
            builder.add_chunk(seq, row, count, bm.rows.num_slots(seq.seq_id), slots, copies)
            budget[0] -= count
        self._after_chunks([s for s, _ in chunks])
        return num_preempted

    def _schedule_running_forked(self, builder: PlanBuilder, budget: list[int]) -> int:
        """Pass 1 while some running group has several sequences (n > 1, beams): they may write
        into a shared block, so every row goes through `append_slots` (copy-on-write)."""
        bm = self.block_manager
        num_preempted = 0
        while True:
            batch = self._running_batch()
            seqs = batch.seqs
            chunks = self._plan_partial(budget[0] - len(seqs)) if self._partial else []
            if not seqs and not chunks:
                return num_preempted
            rows, counts = batch.rows, None
            if chunks:
                rows = np.concatenate([rows, bm.rows.rows_of([s.seq_id for s, _ in chunks])])
                counts = np.array([1] * len(seqs) + [c for _, c in chunks], dtype=np.int64)
            appended = bm.append_slots(rows, counts)
            if appended is not None:
                break
            num_preempted += self._preempt_latest()
        slots, copies = appended
        batch.advance()  # its slots came from append_slots: its cursor no longer holds
        if not chunks:
            builder.add(seqs, rows, None, slots, copies)
            budget[0] -= len(seqs)
            return num_preempted
        builder.add(seqs + [s for s, _ in chunks], rows, counts, slots, copies)
        budget[0] -= len(slots)
        self._after_chunks([s for s, _ in chunks])
        return num_preempted

    def _plan_partial(self, room: int) -> list[tuple[Sequence, int]]:
        """(sequence, new tokens) of the partly prefilled groups, FCFS, within `room` tokens.

        Sequences of a recomputed group join it here: a sequence forks the blocks of the common
        prefix it shares with an earlier one once that prefix was computed in an earlier step. A
        recomputed group rejoins as a unit (beam search needs all its beams in one step): unless
        every sequence can finish now, each stops one token short of its end.
        """
        chunks: list[tuple[Sequence, int]] = []
        for group in self._partial:
            seqs = group.live_seqs()
            aligned = len(seqs) > 1
            if aligned:
                todo = [self._uncomputed(s) if self._resident(s) else len(s) - self._joining[s.seq_id][1]
                        for s in seqs]
                whole = (all(self._resident(s) or self._can_attach(s) for s in seqs)
                         and sum(todo) <= room and max(todo) <= self.chunk_limit)
            for seq in seqs:
                if not self._resident(seq):
                    if not self._can_attach(seq):
                        continue
                    self._attach(seq)
                todo = self._uncomputed(seq) - (1 if aligned and not whole else 0)
                count = min(todo, room, self.chunk_limit)
                if count > 0:
                    chunks.append((seq, count))
                    room -= count
        return chunks

    def _after_chunks(self, seqs: list[Sequence]) -> None:
        """Groups whose every sequence is now scheduled to its end leave the partial list; the full
        blocks the chunks write join the prefix cache (later admissions may share them at once)."""
        for group in {id(s.group): s.group for s in seqs}.values():
            live = group.live_seqs()
            if all(self._resident(s) and self._uncomputed(s) == 0 for s in live):
                self._partial.remove(group)
                self._batch_joins.append(group)  # its sequences decode from the next step on
            if self.prefix_caching:
                self._kv_events += 1
                for seq in live:
                    if self._resident(seq):
                        self.block_manager.cache_blocks(seq.seq_id, seq.token_ids, group.cache_salt, seq.block_keys)

    def _preempt_latest(self) -> int:
        """Preempts the latest-arrived running group (returns 1), or aborts it when it runs alone:
        then it has outgrown the whole pool (returns 0)."""
        victim = self.running[-1]
        if len(self.running) == 1:
            self._reject(victim, "its sequences outgrew the whole KV pool "
                                 f"({self.block_manager.num_usable_blocks} blocks)")
            self.abort(victim)
            return 0
        self._leave_running(victim)
        if self._num_multi_running:
            self._batch = None
        elif self._batch is not None:
            self._batch.discard(victim.seqs)
        self._preempt(victim)
        return 1

    def _preempt(self, group: SequenceGroup) -> None:
        """Evicts a whole group: swap when configured and room allows, else recompute."""
        bm = self.block_manager
        self._kv_events += 1
        resident = [s for s in group.live_seqs() if bm.rows.has_seq(s.seq_id)]
        whole = len(resident) == len(group.live_seqs())  # a group still joining its blocks recomputes
        ids = [s.seq_id for s in resident]
        if self.config.preemption_mode == "swap" and whole and bm.swap is not None and bm.swap.can_swap_out(ids):
            self._builder.swap_out(bm.swap.swap_out(ids))
            for seq in resident:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            return
        for seq in group.live_seqs():
            self._release(seq)
            seq.status = SequenceStatus.WAITING
        # Back to the front: FCFS by arrival, ahead of every request that arrived later.
        self.waiting.appendleft(group)

    def _swap_in(self, builder: PlanBuilder, budget: list[int]) -> None:
        """Pass 2: brings swapped groups back, FIFO, while room allows; they decode this step."""
        bm, swap = self.block_manager, self.block_manager.swap  # (groups swap out only with a swap space)
        num_appends = 0  # blocks the groups swapped in so far may open for this step's token
        while self.swapped:
            group = self.swapped[0]
            seqs = group.live_seqs(SequenceStatus.SWAPPED)
            ids = [s.seq_id for s in seqs]
            num_appends += len(ids)
            if self._num_running_seqs + group.width > self.config.max_num_seqs or budget[0] < len(ids):
                break
            if not swap.can_swap_in(ids, num_appends, self._headroom()):
                if not self.running and swap.blocks_needed(ids) + len(ids) > bm.num_usable_blocks:
                    self.swapped.popleft()
                    self._reject(group, "its sequences outgrew the whole KV pool "
                                        f"({bm.num_usable_blocks} blocks)")
                    self.abort(group)
                    continue
                break
            self.swapped.popleft()
            pairs = swap.swap_in(ids)
            self._kv_events += 1
            builder.swap_in(pairs)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self._join_running(group)
            if any(self._uncomputed(s) != 1 for s in seqs):  # swapped mid-prompt: chunks resume next step
                bisect.insort(self._partial, group, key=lambda g: g.arrival_order)
                continue
            rows = bm.rows.rows_of(ids)
            slots, copies = bm.append_slots(rows)  # room was checked by can_swap_in
            builder.add(seqs, rows, None, slots, copies)
            budget[0] -= len(seqs)

    def _admit(self, builder: PlanBuilder, budget: list[int], admitted: list[SequenceGroup]) -> None:
        """Pass 3: admits waiting groups, FCFS, while the budgets and blocks allow.

        A group's first sequence (its prompt, or a recomputed sequence's whole history) starts
        here; the other sequences of a recomputed group share the common prefix blocks they had
        (`_share`) and join in the same step (paper: whole prompts) or in later ones (chunked). A
        group that can never fit the pool is rejected (`KVCacheManager.fits`).
        """
        bm = self.block_manager
        while not self._nothing_to_admit(budget[0]):
            group = self.waiting[0]
            seqs = group.live_seqs() if not group.is_single else group.seqs
            leader, followers = seqs[0], seqs[1:]  # followers: a recomputed group's other sequences
            hits = (bm.match_prefix(leader.token_ids, group.cache_salt, leader.block_keys)
                    if self.prefix_caching else [])
            cached = len(hits) * bm.block_size
            shares = [self._share(f) for f in followers] if followers else []
            unique_blocks = (sum(bm.rows.blocks_for(len(f)) - blocks for f, (_, _, blocks) in zip(followers, shares))
                             if followers else 0)
            if not bm.fits(len(leader), width=group.width, final_len=group.max_total_len, extra_blocks=unique_blocks):
                need = bm.rows.blocks_for(len(leader)) + unique_blocks
                self.waiting.popleft()
                self._reject(group, f"needs {need} KV blocks, more than the pool can ever give "
                                    f"({bm.num_usable_blocks} blocks)")
                continue
            if self.chunked:  # the first sequence's first chunk; the others join in later steps, and
                # until they do it stops one token short of its end (the group rejoins as a unit)
                room = min(budget[0], self.chunk_limit)
                if room <= 0:
                    break
                remaining = len(leader) - cached - (1 if followers else 0)
                count = min(remaining, room)  # 0: nothing until they join
                extra_tokens = extra_blocks = 0
            else:  # whole prompts; the budget binds after the step's first group
                remaining = count = len(leader.token_ids) - cached
                extra_tokens = sum(len(f) - tokens for f, (_, tokens, _) in zip(followers, shares)) if followers else 0
                extra_blocks = unique_blocks
                if admitted and count + extra_tokens > budget[0]:
                    break
            if not bm.can_admit(len(leader), cached + count, hits, width=group.width, final_len=group.max_total_len,
                                headroom=self._headroom(), extra_blocks=extra_blocks):
                self._held_back = True
                self._held_back_at = (group, self._kv_events, self._num_running_seqs, remaining, count)
                self._held_back_free = bm.num_free_blocks
                break
            self.waiting.popleft()
            self._kv_events += 1
            bm.admit(leader.seq_id, hits, width=group.width, final_len=group.max_total_len, num_tokens=len(leader))
            self.num_cached_tokens += cached
            self.num_prompt_tokens += sum(len(s.token_ids) for s in seqs) if followers else len(leader.token_ids)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            if followers:
                self._joining.update((f.seq_id, share) for f, share in zip(followers, shares))
            self._join_running(group)
            admitted.append(group)
            if count:
                self._schedule_chunk(builder, budget, leader, count)
            if not self.chunked:
                for follower in followers:  # the blocks they share are written this step: join now
                    self._attach(follower)
                    self._schedule_chunk(builder, budget, follower, self._uncomputed(follower))
            # (Whole-prompt admission schedules every sequence to its end: never partial.)
            if self.chunked and any(not self._resident(s) or self._uncomputed(s) for s in seqs):
                bisect.insort(self._partial, group, key=lambda g: g.arrival_order)
            if self.prefix_caching:
                for seq in seqs:
                    if self._resident(seq) and len(seq.token_ids) >= bm.block_size:  # it has a full block
                        bm.cache_blocks(seq.seq_id, seq.token_ids, group.cache_salt, seq.block_keys)

    def _nothing_to_admit(self, tokens_left: int) -> bool:
        """Whether admission stops before trying the queue's head: nothing waits, admission is
        closed, the head would pass max_num_seqs, or it was held back for lack of blocks and
        nothing it depends on changed since (then `_held_back` is set).

        Besides the free blocks (fewer of which cannot help), a held-back head depends on every
        block event since (frees, admissions, forks, swaps, cache inserts: its length, its prefix
        hits and the running set change only with one), the running sequences (headroom,
        max_num_seqs) and how many tokens it would schedule: its prompt's rest, or what
        `tokens_left` leaves of it (chunked prefill).
        """
        if not self.waiting or not self._may_admit():
            return True
        group = self.waiting[0]
        if self._num_running_seqs + group.width > self.config.max_num_seqs:
            return True
        held_group, events, num_running, remaining, count = self._held_back_at
        if (group is held_group and self._kv_events == events and self._num_running_seqs == num_running
                and (not self.chunked or min(remaining, tokens_left, self.chunk_limit) == count)
                and self.block_manager.num_free_blocks <= self._held_back_free):
            self._held_back = True
            return True
        return False

    def _schedule_chunk(self, builder: PlanBuilder, budget: list[int], seq: Sequence, count: int) -> None:
        """Slots for the next `count` tokens of a sequence just admitted (room was checked)."""
        bm = self.block_manager
        row = bm.rows.row_of(seq.seq_id)
        slots, copies = bm.append_row(row, count)
        builder.add_chunk(seq, row, count, bm.rows.num_slots(seq.seq_id), slots, copies)
        budget[0] -= count

    def _may_admit(self) -> bool:
        """Whether new groups may join now (request-level batching closes this between batches)."""
        return True

    # ------------------------------------------------------------------ helpers

    def _headroom(self) -> int | None:
        """Free blocks admission and swap-in keep: the manager's watermark (None), waived when
        nothing else runs (no one could be preempted to make room, and a group that fits the pool
        must progress)."""
        return None if self.running else 0

    def _reject(self, group: SequenceGroup, reason: str) -> None:
        self._rejected.append((group, reason))

    def _resident(self, seq: Sequence) -> bool:
        return self.block_manager.rows.has_seq(seq.seq_id)

    def _uncomputed(self, seq: Sequence) -> int:
        """Tokens of a sequence still to run through the model: a prompt (or its rest), or the
        last sampled token. (Its computed ones are the slots its row holds.)"""
        return len(seq.token_ids) - self.block_manager.rows.num_slots(seq.seq_id)

    def _share(self, seq: Sequence) -> tuple[Sequence | None, int, int]:
        """(earlier sequence of the group, shared tokens, shared blocks) of the longest common prefix of
        whole blocks `seq` has with an earlier live sequence of its group (recompute keeps sharing)."""
        bs = self.block_manager.block_size
        best: tuple[Sequence | None, int, int] = (None, 0, 0)
        limit = (len(seq) - 1) // bs  # never the last token: it computes the logits to sample from
        for other in seq.group.live_seqs():
            if other is seq:
                break
            common = 0
            for a, b in zip(seq.token_ids, other.token_ids):
                if a != b:
                    break
                common += 1
            blocks = min(common // bs, limit)
            if blocks > best[2]:
                best = (other, blocks * bs, blocks)
        return best

    def _can_attach(self, seq: Sequence) -> bool:
        """Whether a joining sequence's shared prefix is computed (in an earlier step, or in this
        one by whole-prompt admission)."""
        source, tokens, _ = self._joining[seq.seq_id]
        if source is not None and source.status.is_finished:  # its source left the group: share anew
            self._joining[seq.seq_id] = source, tokens, _ = self._share(seq)
        return source is None or self.block_manager.rows.num_slots(source.seq_id) >= tokens

    def _attach(self, seq: Sequence) -> None:
        """Gives a joining sequence of a recomputed group its row, forking its shared prefix."""
        source, tokens, blocks = self._joining.pop(seq.seq_id)
        self._kv_events += 1
        if source is None:
            self.block_manager.admit(seq.seq_id, final_len=seq.group.max_total_len, num_tokens=len(seq))
        else:
            self.block_manager.fork(source.seq_id, seq.seq_id, blocks)

    def _running_batch(self) -> DecodeBatch:
        """Decoding sequences of the running groups (partial ones excluded) and their block-table
        rows: the kept batch, brought up to date with the events since the last step."""
        batch = self._batch
        if batch is None:
            running = SequenceStatus.RUNNING
            if not self._partial and self._num_multi_running == 0:  # one running sequence per group
                seqs = [g.seqs[0] for g in self.running]
            else:
                partial = {id(g) for g in self._partial}
                seqs = [s for g in self.running if id(g) not in partial for s in g.seqs if s.status is running]
            self._batch = batch = DecodeBatch(self.block_manager, seqs)
            self._batch_joins.clear()
            self._batch_drops.clear()
            return batch
        if self._batch_drops:
            if self._num_multi_running:
                self._batch = None
                return self._running_batch()
            batch.discard(self._batch_drops)
            self._batch_drops.clear()
        if self._batch_joins:
            # (A group that left running since has no running sequence: preempted or ended.)
            running = SequenceStatus.RUNNING
            for group in self._batch_joins:
                if group.is_single:
                    if group.seqs[0].status is running and group not in self._partial:
                        batch.add(group.seqs)
                elif group not in self._partial:
                    batch.add([s for s in group.seqs if s.status is running])
            self._batch_joins.clear()
        return batch
