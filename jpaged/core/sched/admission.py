"""Admission: the waiting queue's door into the running set, FCFS, within the step's budgets and blocks.

A waiting group starts through its first sequence (its prompt, or a recomputed sequence's whole
history, less the prefix-cache hits); the other sequences of a recomputed group wait to share
the common prefix blocks they had (`jpaged.core.sched.rejoin`) and join in the same step (policy paper:
whole prompts, the token budget binding after the step's first group) or in later ones (chunked:
the first chunk now). A group that can never fit the pool (`KVCacheManager.fits`) is rejected;
one that does not fit now holds the queue back.

The queue's head is retried every step; while nothing its answer depends on has changed since it
was held back (`HeldBack`), the retry is skipped. A change is a block event (frees, admissions,
forks, swaps, cache inserts: a group's length, its prefix hits and the running set change only
with one), which the KV manager counts itself (`KVCacheManager.num_events`), or a change in the running sequences,
the free blocks, or (chunked) the tokens the head would schedule. Pure Python: no jax import.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, NamedTuple

from jpaged.core.kv.prefix_cache import NO_HIT
from jpaged.core.sequence import SequenceStatus

if TYPE_CHECKING:
    from jpaged.config import SchedulerConfig
    from jpaged.core.kv.kv_manager import KVCacheManager
    from jpaged.core.sched.rejoin import Rejoin
    from jpaged.core.sched.running_set import RunningSet
    from jpaged.core.sequence import SequenceGroup
    from jpaged.core.sched.step_draft import StepDraft


class HeldBack(NamedTuple):
    """The queue's head as admission last held it back for lack of blocks, and what that answer
    depended on (see the module docstring)."""

    group: SequenceGroup | None
    kv_events: int  # the KV manager's block events then (`num_events`)
    num_running_seqs: int  # the running groups' widths (the headroom, max_num_seqs)
    remaining: int  # prompt tokens it had left
    count: int  # tokens it asked for (chunked: what the budget left of `remaining`)
    free_blocks: int  # free blocks (fewer cannot be enough)


class Admission:
    """The waiting queue and its admission pass (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, running: RunningSet, rejoin: Rejoin,
                 chunk_limit: int):
        self.kv = kv
        self.running = running
        self.rejoin = rejoin
        self.max_num_seqs = config.max_num_seqs
        self.chunked = config.policy == "chunked"
        self.chunk_limit = chunk_limit  # most new tokens per sequence per step
        self.prefix_caching = kv.prefix_cache is not None
        self.waiting: collections.deque[SequenceGroup] = collections.deque()  # FCFS
        self.held_back = HeldBack(None, -1, -1, -1, -1, 0)
        self.num_prompt_tokens = 0  # prompt tokens admitted for prefill (prompts, and recomputed outputs)
        self.num_cached_tokens = 0  # of those, tokens served from the prefix cache

    def blocked(self, may_admit: bool, tokens_left: int) -> bool | None:
        """Why admission would stop before trying the queue's head: None when nothing stops it; False
        when nothing waits, admission is closed (not `may_admit`: request-level batching) or the
        head would pass max_num_seqs; True when the head was held back for lack of blocks and
        nothing it depends on changed since (`tokens_left`: the step's budget as admission would
        find it). (Every step asks, the decode fast path included: one call.)"""
        waiting = self.waiting
        if not waiting or not may_admit:
            return False
        head, num_running = waiting[0], self.running.num_seqs
        if num_running + head.width > self.max_num_seqs:
            return False
        held = self.held_back
        if (head is held.group and self.kv.num_events == held.kv_events and num_running == held.num_running_seqs
                and (not self.chunked or min(held.remaining, tokens_left, self.chunk_limit) == held.count)
                and self.kv.num_free_blocks <= held.free_blocks):
            return True
        return None

    def admit(self, step: StepDraft, may_admit: bool) -> None:
        """The admission pass: admits waiting groups, FCFS, while the budgets and blocks allow."""
        kv, rows, rejoin = self.kv, self.kv.rows, self.rejoin
        while True:
            blocked = self.blocked(may_admit, step.tokens)
            if blocked is not None:
                step.held_back = step.held_back or blocked
                break
            group = self.waiting[0]
            seqs = group.live_seqs() if not group.is_single else group.seqs
            leader, followers = seqs[0], seqs[1:]  # followers: a recomputed group's other sequences
            num_tokens = len(leader.token_ids)
            # A prompt that still owes log-probabilities computes every position: cached ones have no logits.
            hits = (kv.match_prefix(leader.token_ids, group.cache_salt, leader.block_keys)
                    if self.prefix_caching and not group.wants_prompt_logprobs else NO_HIT)
            cached = hits.num_tokens
            shares = [rejoin.share(f) for f in followers] if followers else []
            unique_blocks = (sum(rows.blocks_for(len(f.token_ids)) - share.blocks for f, share in zip(followers, shares))
                             if followers else 0)
            if not kv.fits(num_tokens, width=group.width, final_len=group.max_total_len, extra_blocks=unique_blocks,
                           hits=hits):
                self.waiting.popleft()
                step.rejected.append((group, f"needs {rows.blocks_for(num_tokens) + unique_blocks} KV blocks, "
                                             f"more than the pool can ever give ({kv.num_usable_blocks} blocks)"))
                continue
            if self.chunked:  # the first sequence's first chunk; the others join in later steps, and
                # until they do it stops one token short of its end (the group rejoins as a unit)
                room = min(step.tokens, self.chunk_limit)
                if room <= 0:
                    break
                remaining = num_tokens - cached - (1 if followers else 0)
                count = min(remaining, room)  # 0: nothing until they join
                extra_blocks = 0
            else:  # whole prompts; the budget binds after the step's first group
                remaining = count = num_tokens - cached
                extra_blocks = unique_blocks
                if step.admitted and count + (sum(len(f.token_ids) - s.tokens for f, s in zip(followers, shares))
                                              if followers else 0) > step.tokens:
                    break
            headroom = None if self.running.groups else 0  # (the watermark, waived when nothing else runs)
            if not kv.can_admit(num_tokens, cached + count, hits, width=group.width, final_len=group.max_total_len,
                                headroom=headroom, extra_blocks=extra_blocks):
                step.held_back = True
                self.held_back = HeldBack(group, kv.num_events, self.running.num_seqs, remaining, count,
                                          kv.num_free_blocks)
                break
            self.waiting.popleft()
            kv.admit(leader.seq_id, hits, width=group.width, final_len=group.max_total_len, num_tokens=num_tokens)
            self.num_cached_tokens += cached
            self.num_prompt_tokens += sum(len(s.token_ids) for s in seqs) if followers else num_tokens
            for seq in seqs:
                seq.status = SequenceStatus.RUNNING
            for follower, share in zip(followers, shares):
                rejoin.wait(follower, share)
            self.running.join(group)
            step.admitted.append(group)
            if count:
                step.add_chunk(leader, count)
            if not self.chunked:
                for follower in followers:  # the blocks they share are written this step: join now
                    rejoin.attach(follower)
                    step.add_chunk(follower, len(follower.token_ids) - rows.num_slots(follower.seq_id))
            # (Whole-prompt admission schedules every sequence to its end: never partial.)
            if self.chunked and any(not rows.has_seq(s.seq_id) or len(s.token_ids) > rows.num_slots(s.seq_id)
                                    for s in seqs):
                self.running.mark_partial(group)
            if self.prefix_caching:
                for seq in seqs:
                    if rows.has_seq(seq.seq_id) and len(seq.token_ids) >= kv.block_size:  # it has a full block
                        kv.cache_blocks(seq.seq_id, seq.token_ids, group.cache_salt, seq.block_keys)
