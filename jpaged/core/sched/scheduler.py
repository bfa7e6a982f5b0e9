"""Iteration-level scheduling by token budget: the paper's vLLM and chunked prefill as two settings.

Every step has a token budget (`max_num_batched_tokens`) and a sequence budget (`max_num_seqs`).
A sequence's computed tokens are the slots its block-table row holds (`RowStore.num_slots`:
taking slots is scheduling tokens); a step gives each scheduled sequence some new tokens,
always the last ones of its context (a prompt chunk, or the one token sampled last), so one
StepPlan describes any mix. Three passes fill a step (a `StepDraft`):

1. running groups: every decoding sequence gets its token (the budget reserves them first), then
   partly prefilled groups get prompt chunks from what is left; when blocks run out, the
   latest-arrived group is preempted whole (swap or recompute), and a group that cannot continue
   even alone has outgrown the pool and is aborted with an error;
2. swapped groups come back, FIFO, while blocks allow (only if nothing was preempted);
3. waiting groups are admitted, FCFS, while the budgets and blocks allow, unless swapped groups
   wait (`jpaged.core.sched.admission`).

`policy: paper` is the paper's vLLM (v0): admission comes first and a step that admits runs only
whole prompts (the token budget binds after its first group, so a long recompute still runs);
`policy: chunked` is vLLM v1 / Sarathi-Serve: decodes first, prompts chunked into what is left.
In the steady state a step is the running batch's decode step alone (the decode fast path,
`jpaged.core.sched.running_set`); a recomputed group's sequences rejoin it through
`jpaged.core.sched.rejoin`. The memory manager is any `kv_manager.KVCacheManager`; what happens after a
step (appending tokens, forks, beams, stop checks, frees) lives in `jpaged.core.sched.postprocess`.
Pure Python + numpy.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Protocol

import numpy as np

from jpaged.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jpaged.core.sched import draft_mirror
from jpaged.core.sched.admission import Admission
from jpaged.core.kv.block_manager import BlockManager
from jpaged.core.sched.persistent_batch import PersistentBatch
from jpaged.core.kv.kv_manager import NO_CACHE_STATS, KVCacheManager
from jpaged.core.sched.plan_builder import PlanBuilder, batch_plan, verify_plan
from jpaged.core.sched.rejoin import Rejoin
from jpaged.core.sched.running_set import RunningSet
from jpaged.core.sched.speculation import Speculator
from jpaged.core.sequence import Sequence, SequenceGroup, SequenceStatus
from jpaged.core.sched.step_draft import StepDraft
from jpaged.core.step_plan import StepPlan, pairs_array

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
    batch: PersistentBatch | None = None


class BatchingRule(Protocol):
    """When waiting groups may join the running set, for a scheduler that does not let them join
    at every step (the paper's request-level baseline: `jpaged.paper.baselines.request_level`)."""

    def may_admit(self, scheduler: Scheduler) -> bool:
        """Whether the step about to be scheduled may admit waiting groups (asked as it starts)."""

    def stepped(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        """Sees each scheduled step (after its passes) to decide on the next ones."""


class Scheduler:
    """FCFS waiting queue, running set and swapped queue over one KV memory manager."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, kv_manager: KVCacheManager | None = None,
                 batching: BatchingRule | None = None, speculative: SpeculativeConfig | None = None):
        """`kv_manager`: the paged `BlockManager` of `cache` by default; `batching`: None for
        iteration-level scheduling (groups join at any step), else the rule that gates admission;
        `speculative`: drafts verified in decode steps (jpaged.core.sched.speculation), None or
        off: none."""
        self.config = config
        self.batching = batching
        self._admitting = True  # whether the step being scheduled may admit (the batching rule's answer)
        self.block_manager: KVCacheManager = kv_manager or BlockManager(
            cache.sized_num_blocks, cache.block_size, cache.num_host_blocks, config.max_model_len,
            watermark=cache.watermark, max_seqs=config.max_num_seqs,
            enable_prefix_caching=cache.enable_prefix_caching, num_host_cache_blocks=cache.num_host_cache_blocks,
            eviction_policy=cache.eviction_policy)
        self.prefix_caching = self.block_manager.prefix_cache is not None
        # The prefix cache's host tier, whose copies join each step's plan (None: no tier).
        self.host_tier = self.block_manager.prefix_cache.host if self.prefix_caching else None
        self.chunked = config.policy == "chunked"
        self.chunk_limit = config.long_prefill_token_threshold or _NO_LIMIT  # most new tokens per sequence per step
        self.running_set = RunningSet(self.block_manager)
        self.running = self.running_set.groups  # the running groups, by arrival_order (the same list)
        self.swapped: collections.deque[SequenceGroup] = collections.deque()
        self.rejoin = Rejoin(self.block_manager)
        self.admission = Admission(config, self.block_manager, self.running_set, self.rejoin, self.chunk_limit)
        self.waiting = self.admission.waiting  # FCFS (the same deque)
        self.speculator: Speculator | None = None
        if speculative is not None and speculative.enabled:
            if not isinstance(self.block_manager, BlockManager) or batching is not None:
                raise ValueError(f"speculative.method: {speculative.method!r} needs the paged block manager and "
                                 f"iteration-level batching, got {type(self.block_manager).__name__}")
            self.speculator = Speculator(speculative, config.max_num_seqs, config.max_num_batched_tokens)
        # A draft model whose speculation turns off above a batch size runs only beside the steps
        # planned while it may draft (jpaged.core.sched.draft_mirror); otherwise beside every step.
        self.skips_draft = (self.speculator is not None and speculative.method == "draft_model"
                            and speculative.disable_by_batch_size is not None)
        self.num_preemptions = 0
        self._touched: list[SequenceGroup] = []  # groups that freed a sequence since remove_finished
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
            self.running_set.leave(group)
            self.running_set.drop(group.seqs)
        for seq in group.seqs:
            self._release(seq)

    def free_seq(self, seq: Sequence) -> None:
        """Frees a finished (or dropped) sequence's blocks; with prefix caching they stay cached."""
        self._release(seq)
        self.running_set.drop((seq,))
        self._touched.append(seq.group)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        """Shares the parent's blocks with a new sequence of the same group (count + 1)."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        self.running_set.rebuild()

    def remove_finished(self) -> None:
        """Drops finished groups from the running list (after sequences finished)."""
        if self._touched:
            for group in {id(g): g for g in self._touched}.values():
                if group.is_finished and group in self.running:
                    self.running_set.leave(group)
            self._touched.clear()

    def _release(self, seq: Sequence) -> None:
        """Gives back a sequence's blocks: device ones (full ones offered to the prefix cache) or host."""
        self.rejoin.forget(seq.seq_id)
        seq.draft_lag = None  # (its draft K/V goes with its blocks: a recompute mirrors it again)
        bm = self.block_manager
        if bm.rows.has_seq(seq.seq_id):
            if self.prefix_caching:
                bm.cache_blocks(seq.seq_id, seq.token_ids, seq.group.cache_salt, seq.block_keys)
            bm.free(seq.seq_id)
        elif bm.swap is not None and bm.swap.holds(seq.seq_id):
            bm.free(seq.seq_id)

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> SchedulerOutput:
        """Decides the next step's batch (see the module docstring for the three passes), and the
        host tier's copies of the step: offloads of the device blocks it evicted, promotions of
        the host blocks its admissions matched (swapped in with the swapped groups)."""
        if self.batching is not None:
            self._admitting = self.batching.may_admit(self)
        tier = self.host_tier
        if tier is None:
            out = self._passes()
        else:
            tier.settle()  # host blocks the last step read or wrote are free again
            out = self._passes()
            offloads, promotions = tier.take_ops()
            if offloads:
                out.plan.offload_pairs = pairs_array(offloads)
            if promotions:
                out.plan.swap_in_pairs = pairs_array(out.plan.swap_in_pairs.tolist() + promotions)
        if self.batching is not None:
            self.batching.stepped(self, out)
        if self.skips_draft:
            self._place_draft(out.plan)
        return out

    def schedule_decode(self) -> SchedulerOutput | None:
        """The decode fast path alone: the running batch's next decode step when nothing changed
        since the last step and admission would stop at once; else None, and nothing changed.
        (The overlapped engine schedules a step ahead with it: `jpaged.core.sched.overlap`.) None with a
        host tier: a decode step's new blocks may evict cached ones to host, copies that
        `schedule` settles step by step. None while speculation may run at the running set's
        size: a verify step's inputs are the step before's accepted tokens, so it is never
        scheduled ahead."""
        if self.host_tier is not None:
            return None
        if self.speculator is not None and self.speculator.may_draft(self.running_set.num_seqs):
            return None
        out = self._steady_step()[0]
        if out is not None and self.skips_draft:
            self._place_draft(out.plan)
        return out

    def _place_draft(self, plan: StepPlan) -> None:
        """Whether the draft model runs beside `plan` (not a verify step: its draft loop is the
        draft's run, and `_verify_step` adds its catch-up): not while speculation is off at the
        running set's size, else with the catch-up of the plan's lagging sequences
        (jpaged.core.sched.draft_mirror)."""
        if not plan.num_seqs or (plan.sampling is not None and plan.sampling.spec_offsets is not None):
            return
        if not self.speculator.may_draft(self.running_set.num_seqs):
            draft_mirror.skip(plan)
            return
        catch_up = draft_mirror.CatchUp.of(plan.seqs, draft_mirror.first_positions(plan),
                                           self.config.max_num_batched_tokens)
        plan.draft_catchup = catch_up.apply(self.block_manager)

    def _steady_step(self) -> tuple[SchedulerOutput | None, bool | None]:
        """(the fast path's step or None, why admission stops: None when it would not)."""
        batch = self.running_set.steady(self.swapped)
        if batch is None:
            return None, None
        # The decode fast path: the running set is as the last step left it and admission
        # would stop at once, so the three passes come down to the batch's decode step.
        tokens_left = self.config.max_num_batched_tokens - (len(batch) if self.chunked else 0)
        held_back = self.admission.blocked(self._admitting, tokens_left)  # (True: for lack of blocks)
        if held_back is None:
            return None, None
        decoded = batch.step()
        if decoded is None:
            return None, held_back
        return SchedulerOutput(batch_plan(batch, *decoded), [], [], 0, held_back, batch), held_back

    def _passes(self) -> SchedulerOutput:
        """A verify step, the decode fast path, or the three passes."""
        if self.speculator is not None:
            out = self._verify_step()
            if out is not None:
                return out
        out, held_back = self._steady_step()
        if out is not None:
            return out
        step = StepDraft(PlanBuilder(self.block_manager), self.config.max_num_batched_tokens, held_back is True)
        if not self.chunked and not self.swapped:  # paper: prefill steps come first
            self.admission.admit(step, self._admitting)
        if self.chunked or not step.admitted:
            self._schedule_running(step)
            if step.num_preempted == 0 and self.swapped:
                self._swap_in(step)
            if self.chunked and not self.swapped and step.num_preempted == 0:  # (vLLM v1: none after a preemption)
                self.admission.admit(step, self._admitting)
        self.num_preemptions += step.num_preempted
        builder = step.builder
        plan = builder.build(all_single=self.running_set.num_multi == 0)
        leading = builder.leading_batch if plan.sampling is not None and plan.sampling.num_batch_rows else None
        return SchedulerOutput(plan, step.admitted, step.rejected, step.num_preempted,
                               step.num_preempted > 0 or step.held_back, leading)

    def _verify_step(self) -> SchedulerOutput | None:
        """A decode step that verifies drafts (jpaged.core.sched.speculation): when the step would
        be the running sequences' decodes alone (nothing partial or swapped, admission stopping at
        once), some sequence has drafts and the blocks for them are free. Else None, and nothing
        changed: the step runs without speculation (which preempts, if blocks are short)."""
        running_set = self.running_set
        if (not running_set.groups or running_set.partial or self.swapped
                or not self.speculator.may_draft(running_set.num_seqs)):
            return None
        batch = running_set.current()
        tokens_left = self.config.max_num_batched_tokens - (len(batch) if self.chunked else 0)
        held_back = self.admission.blocked(self._admitting, tokens_left)
        if held_back is None or not batch.seqs:
            return None
        drafts = self.speculator.drafts(batch.seqs)
        if drafts is None:
            return None
        catch_up = None
        if self.skips_draft:  # a sequence whose draft K/V this step cannot complete drafts nothing
            catch_up = draft_mirror.CatchUp.of(batch.seqs, [len(s.token_ids) - 1 for s in batch.seqs],
                                               self.config.max_num_batched_tokens)
            drafts = [[] if lagging else d for d, lagging in zip(drafts, catch_up.lagging())]
            if not any(drafts):
                return None
        rows = batch.rows
        appended = self.block_manager.append_slots(rows, np.array([1 + len(d) for d in drafts], np.int64))
        if appended is None:
            return None
        batch.advance(uneven=True)  # (its sequences gain up to k + 1 tokens each)
        plan = verify_plan(self.block_manager, list(batch.seqs), rows, drafts, *appended)
        if catch_up is not None:
            plan.draft_catchup = catch_up.apply(self.block_manager)
        return SchedulerOutput(plan, [], [], 0, held_back is True)

    def _schedule_running(self, step: StepDraft) -> None:
        """Pass 1: decode tokens of running groups, then chunks of partly prefilled ones. The
        decodes and the chunks get their slots all or nothing: while blocks are short, the
        latest-arrived group is preempted."""
        if self.running_set.num_multi:
            return self._schedule_running_forked(step)
        bm = self.block_manager
        while True:  # one sequence per group: the batch decodes through its cursor
            batch = self.running_set.current()
            seqs = batch.seqs
            chunks = self._plan_partial(step.tokens - len(seqs)) if self.running_set.partial else []
            if not chunks:
                if not seqs:
                    return
                decoded = batch.step()  # the steady state: (step arrays, block tables)
                if decoded is not None:
                    step.builder.add_decodes(batch, *decoded)
                    step.tokens -= len(seqs)
                    return
            else:
                chunk_rows = [bm.rows.row_of(s.seq_id) for s, _ in chunks]
                chunk_counts = [c for _, c in chunks]
                if (batch.blocks_needed() if seqs else 0) + bm.blocks_needed(chunk_rows, chunk_counts) \
                        <= bm.num_free_blocks:
                    break
            self._preempt_latest(step)
        if seqs:  # (room was checked: neither can fail now)
            step.builder.add_decodes(batch, *batch.step())
            step.tokens -= len(seqs)
        for (seq, count), row in zip(chunks, chunk_rows):
            step.add_chunk(seq, count, row)
        self._after_chunks([s for s, _ in chunks])

    def _schedule_running_forked(self, step: StepDraft) -> None:
        """Pass 1 while some running group has several sequences (n > 1, beams): they may write
        into a shared block, so every row goes through `append_slots` (copy-on-write)."""
        bm = self.block_manager
        while True:
            batch = self.running_set.current()
            seqs = batch.seqs
            chunks = self._plan_partial(step.tokens - len(seqs)) if self.running_set.partial else []
            if not seqs and not chunks:
                return
            rows, counts = batch.rows, None
            if chunks:
                rows = np.concatenate([rows, bm.rows.rows_of([s.seq_id for s, _ in chunks])])
                counts = np.array([1] * len(seqs) + [c for _, c in chunks], dtype=np.int64)
            appended = bm.append_slots(rows, counts)
            if appended is not None:
                break
            self._preempt_latest(step)
        slots, copies = appended
        batch.advance()  # its slots came from append_slots: its cursor no longer holds
        if not chunks:
            step.builder.add(seqs, rows, None, slots, copies)
            step.tokens -= len(seqs)
            return
        step.builder.add(seqs + [s for s, _ in chunks], rows, counts, slots, copies)
        step.tokens -= len(slots)
        self._after_chunks([s for s, _ in chunks])

    def _plan_partial(self, room: int) -> list[tuple[Sequence, int]]:
        """(sequence, new tokens) of the partly prefilled groups, FCFS, within `room` tokens; the
        sequences of a recomputed group join it here once their shared prefix is computed, and
        stop one token short unless the whole group can finish now (see `jpaged.core.sched.rejoin`)."""
        chunks: list[tuple[Sequence, int]] = []
        rejoin, rows = self.rejoin, self.block_manager.rows
        for group in self.running_set.partial:
            seqs = group.live_seqs()
            short = rejoin.short_by(seqs, room, self.chunk_limit) if len(seqs) > 1 else 0
            for seq in seqs:
                if not rows.has_seq(seq.seq_id):
                    if not rejoin.can_attach(seq):
                        continue
                    rejoin.attach(seq)
                count = min(len(seq.token_ids) - rows.num_slots(seq.seq_id) - short, room, self.chunk_limit)
                if count > 0:
                    chunks.append((seq, count))
                    room -= count
        return chunks

    def _after_chunks(self, seqs: list[Sequence]) -> None:
        """Groups whose every sequence is now scheduled to its end leave the partial list; the full
        blocks the chunks write join the prefix cache (later admissions may share them at once)."""
        bm = self.block_manager
        for group in {id(s.group): s.group for s in seqs}.values():
            live = group.live_seqs()
            if all(bm.rows.has_seq(s.seq_id) and bm.rows.num_slots(s.seq_id) == len(s.token_ids) for s in live):
                self.running_set.prefilled(group)  # its sequences decode from the next step on
            if self.prefix_caching:
                for seq in live:
                    if bm.rows.has_seq(seq.seq_id):
                        bm.cache_blocks(seq.seq_id, seq.token_ids, group.cache_salt, seq.block_keys)

    def _preempt_latest(self, step: StepDraft) -> None:
        """Preempts the latest-arrived running group, or aborts it when it runs alone: then it has
        outgrown the whole pool."""
        victim = self.running[-1]
        if len(self.running) == 1:
            step.rejected.append((victim, "its sequences outgrew the whole KV pool "
                                          f"({self.block_manager.num_usable_blocks} blocks)"))
            self.abort(victim)
            return
        self.running_set.evict(victim)
        self._preempt(step, victim)
        step.num_preempted += 1

    def _preempt(self, step: StepDraft, group: SequenceGroup) -> None:
        """Evicts a whole group: swap when configured and room allows, else recompute."""
        bm = self.block_manager
        resident = [s for s in group.live_seqs() if bm.rows.has_seq(s.seq_id)]
        whole = len(resident) == len(group.live_seqs())  # a group still joining its blocks recomputes
        ids = [s.seq_id for s in resident]
        if self.config.preemption_mode == "swap" and whole and bm.swap is not None and bm.swap.can_swap_out(ids):
            step.builder.swap_out(bm.swap.swap_out(ids))
            for seq in resident:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
            return
        for seq in group.live_seqs():
            self._release(seq)
            seq.status = SequenceStatus.WAITING
        # Back to the front: FCFS by arrival, ahead of every request that arrived later.
        self.waiting.appendleft(group)

    def _swap_in(self, step: StepDraft) -> None:
        """Pass 2: brings swapped groups back, FIFO, while room allows; they decode this step."""
        bm, swap = self.block_manager, self.block_manager.swap  # (groups swap out only with a swap space)
        num_appends = 0  # blocks the groups swapped in so far may open for this step's token
        while self.swapped:
            group = self.swapped[0]
            seqs = group.live_seqs(SequenceStatus.SWAPPED)
            ids = [s.seq_id for s in seqs]
            num_appends += len(ids)
            if self.running_set.num_seqs + group.width > self.config.max_num_seqs or step.tokens < len(ids):
                break
            if not swap.can_swap_in(ids, num_appends, self.headroom()):
                if not self.running and swap.blocks_needed(ids) + len(ids) > bm.num_usable_blocks:
                    self.swapped.popleft()
                    step.rejected.append((group, "its sequences outgrew the whole KV pool "
                                                 f"({bm.num_usable_blocks} blocks)"))
                    self.abort(group)
                    continue
                break
            self.swapped.popleft()
            pairs = swap.swap_in(ids)
            step.builder.swap_in(pairs)
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            self.running_set.join(group)
            if any(len(s.token_ids) - bm.rows.num_slots(s.seq_id) != 1 for s in seqs):  # mid-prompt: chunks next step
                self.running_set.mark_partial(group)
                continue
            rows = bm.rows.rows_of(ids)
            slots, copies = bm.append_slots(rows)  # room was checked by can_swap_in
            step.builder.add(seqs, rows, None, slots, copies)
            step.tokens -= len(seqs)

    def prefix_cache_stats(self) -> dict:
        """The admitted prompts' prefix-cache hit rate (cached tokens / prompt tokens, both tiers),
        with the KV manager's own cache figures (`KVCacheManager.cache_stats`; zeros without a cache)."""
        admission = self.admission
        cache = self.block_manager.cache_stats() if self.prefix_caching else dict(NO_CACHE_STATS)
        return {"prefix_cache_hit_rate": admission.num_cached_tokens / max(admission.num_prompt_tokens, 1),
                "prefix_cached_tokens": admission.num_cached_tokens,
                "prefix_queried_tokens": admission.num_prompt_tokens, **cache}

    def headroom(self) -> int | None:
        """Free blocks swap-in keeps: the manager's watermark (None), waived when nothing else runs
        (no one could be preempted to make room, and a group that fits the pool must progress)."""
        return None if self.running else 0


