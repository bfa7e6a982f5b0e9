"""Shortcuts the KV-manager tests take: a sequence admitted with its first tokens' slots in one call."""

from __future__ import annotations

import numpy as np

from jpaged.core.kv.block_manager import BlockManager
from jpaged.core.kv.prefix_cache import NO_HIT, PrefixHit
from jpaged.paper.baselines.contiguous import ContiguousBlockManager


def allocate(bm: BlockManager, seq_id: int, num_tokens: int, hits: PrefixHit = NO_HIT) -> int:
    """`admit` with the cached prefix `hits`, then slots for the first `num_tokens` tokens (at least
    the cached ones); returns the row. The caller checked `fits` and `can_admit`."""
    row = bm.admit(seq_id, hits)
    if num_tokens > hits.num_tokens:
        assert bm.append_slots(np.array([row]), np.array([num_tokens - hits.num_tokens])) is not None
    return row


def reserve(cm: ContiguousBlockManager, seq_id: int, num_tokens: int, final_len: int, width: int = 1) -> int:
    """`admit` of a contiguous region for a sequence growing to `final_len` (and `width - 1` spare
    regions), then slots for its first `num_tokens` tokens; returns the row."""
    row = cm.admit(seq_id, width=width, final_len=final_len, num_tokens=num_tokens)
    cm.append_slots(np.array([row]), np.array([num_tokens]))
    return row
