"""The paper's Fig. 2 split of a paged pool (jpaged.paper.kv_usage), by hand."""

from jpaged.core.kv.block_manager import BlockManager
from jpaged.paper.kv_usage import paged_usage_breakdown
from tests.helpers.kv import allocate


def test_paged_usage_breakdown_counts_shared_blocks_once():
    bm = BlockManager(11, 4, 6, 64, watermark=0.0, max_seqs=2)
    allocate(bm, 1, 6)
    bm.fork(1, 2)
    # Both will write positions 0..8 (final length 10): 6 written, 2 more slots of block 2 reserved.
    assert paged_usage_breakdown(bm, {1: 10, 2: 10}) == (6, 2, 0, 0)
    # A third sequence, 1 token growing to 3, writes 2 slots of its own block: 1 written, 1 reserved,
    # the block's other 2 never (internal fragmentation).
    allocate(bm, 3, 1)
    assert paged_usage_breakdown(bm, {1: 10, 2: 10, 3: 3}) == (7, 3, 2, 0)
