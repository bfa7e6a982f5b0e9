"""The KV slot space of any system split into the paper's Fig. 2 states, at one instant.

Every usable slot (blocks 1..N-1 times the block size) is in exactly one state:
- token_states: holds the K/V of a token of a live sequence;
- reserved: allocated to a live sequence and will be written before it finishes. A sequence
  writes K/V for its first final_len - 1 positions (final_len = prompt + max_tokens; the last
  sampled token is never fed back);
- internal: allocated but never to be written: Orca's over-reservation past final_len - 1 and
  the buddy's block and power-of-two rounding; vLLM's slots of a sequence's final block past it;
- external: free, but in buddy blocks too small for the region the head of the waiting queue
  needs (0 when nothing waits); paged pools have none, since any free block serves any request;
- free: the rest.
Each memory manager computes its own split (`usage_breakdown`); this module asks it with the
scheduler's view of the sequences.
"""

from __future__ import annotations

from jpaged.core.scheduler import Scheduler
from jpaged.core.sequence import SequenceStatus


def usage_breakdown(scheduler: Scheduler) -> tuple[int, int, int, int]:
    """(token_states, reserved, internal, external) slots of the scheduler's KV pool now."""
    bm = scheduler.block_manager
    final_lens = {s.seq_id: g.max_total_len for g in scheduler.running for s in g.seqs if bm.has_seq(s.seq_id)}
    next_request = None
    if scheduler.waiting:
        head = scheduler.waiting[0]
        tokens = max(len(s) for s in head.live_seqs(SequenceStatus.WAITING))
        next_request = (tokens, head.max_total_len)
    return bm.usage_breakdown(final_lens, next_request)


def total_slots(scheduler: Scheduler) -> int:
    """Usable KV slots of the scheduler's pool (block 0 excluded)."""
    bm = scheduler.block_manager
    return bm.num_usable_blocks * bm.block_size
