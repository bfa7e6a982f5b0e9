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
The contiguous managers split their regions themselves (`ContiguousBlockManager.usage_breakdown`:
the buddy's state is theirs); the paged split is here (`paged_usage_breakdown`), from the block
manager's rows and reference counts and the scheduler's view of the sequences.
"""

from __future__ import annotations

import numpy as np

from jpaged.core.kv.block_manager import BlockManager
from jpaged.core.sched.scheduler import Scheduler
from jpaged.core.sequence import SequenceStatus
from jpaged.paper.baselines.contiguous import ContiguousBlockManager


def usage_breakdown(scheduler: Scheduler) -> tuple[int, int, int, int]:
    """(token_states, reserved, internal, external) slots of the scheduler's KV pool now."""
    bm = scheduler.block_manager
    if isinstance(bm, ContiguousBlockManager):
        next_request = None
        if scheduler.waiting:
            head = scheduler.waiting[0]
            tokens = max(len(s) for s in head.live_seqs(SequenceStatus.WAITING))
            next_request = (tokens, head.max_total_len)
        return bm.usage_breakdown(next_request)
    rows = bm.rows
    final_lens = {s.seq_id: g.max_total_len for g in scheduler.running for s in g.seqs if rows.has_seq(s.seq_id)}
    return paged_usage_breakdown(bm, final_lens)


def paged_usage_breakdown(bm: BlockManager, final_lens: dict[int, int]) -> tuple[int, int, int, int]:
    """(token_states, reserved, internal, 0) slots of a paged pool now; shared blocks count once.

    `final_lens` maps every resident sequence id to its final length; a sequence writes K/V
    for its first final_len - 1 positions. Per distinct allocated block: written = the most
    slots any holder has written, will = the most any holder will write; token_states +=
    written, reserved += will - written, internal += block_size - will. A paged pool has no
    external fragmentation: any free block serves any request.
    """
    store = bm.rows
    rows = np.fromiter((store.row_of(s) for s in final_lens), dtype=np.int64, count=len(final_lens))
    wills = np.fromiter((f - 1 for f in final_lens.values()), dtype=np.int64, count=len(final_lens))
    num_allocated = int(np.count_nonzero(bm.refcount[1:]))
    bs = bm.block_size
    if rows.size == 0:
        return 0, 0, num_allocated * bs, 0
    num_table_blocks = store.num_table_blocks[rows]
    width = int(num_table_blocks.max())
    first_pos = np.arange(width)[None, :] * bs  # [1, W] first position of each logical block
    valid = np.arange(width)[None, :] < num_table_blocks[:, None]  # [R, W]
    written = np.clip(store.num_tokens[rows][:, None] - first_pos, 0, bs)  # [R, W]
    will = np.maximum(np.clip(wills[:, None] - first_pos, 0, bs), written)
    blocks = store.block_tables[rows, :width][valid]
    per_written = np.zeros(bm.num_blocks, dtype=np.int64)  # [N] the most slots any holder wrote
    per_will = np.zeros(bm.num_blocks, dtype=np.int64)  # [N] the most slots any holder will write
    np.maximum.at(per_written, blocks, written[valid])
    np.maximum.at(per_will, blocks, will[valid])
    token, future = int(per_written.sum()), int(per_will.sum())
    return token, future - token, num_allocated * bs - future, 0


def total_slots(scheduler: Scheduler) -> int:
    """Usable KV slots of the scheduler's pool (block 0 excluded)."""
    bm = scheduler.block_manager
    return bm.num_usable_blocks * bm.block_size
