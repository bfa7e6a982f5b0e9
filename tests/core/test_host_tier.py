"""The prefix cache's host tier, pinned prefixes and the eviction policies, case by case."""

import numpy as np
import pytest

from jpaged.core.kv.block_manager import BlockManager
from jpaged.core.kv.eviction import ARCPolicy, LRUPolicy, make_policy
from tests.helpers.kv import allocate


def _serve(bm, seq, prompt, salt=None):
    """Admits `prompt` with its prefix hit, caches its blocks, and frees it (a finished request)."""
    hit = bm.match_prefix(prompt, salt)
    assert bm.can_admit(len(prompt), len(prompt), hit)
    allocate(bm, seq, len(prompt), hit)
    bm.cache_blocks(seq, prompt, salt)
    bm.free(seq)
    return hit


def _tiered(num_blocks=4, tier=1, swap=0, policy="lru"):
    return BlockManager(num_blocks, 2, swap, 16, watermark=0.0, enable_prefix_caching=True,
                        num_host_cache_blocks=tier, eviction_policy=policy)


def test_evicted_blocks_move_to_the_host_tier_and_come_back_as_hits():
    bm = _tiered(num_blocks=4, tier=4)
    tier = bm.prefix_cache.host
    _serve(bm, 1, [1, 2, 3, 4, 9])  # blocks (1, 2) -> (3, 4) cached, the partial one freed
    device = bm.match_prefix([1, 2, 3, 4, 9]).blocks
    _serve(bm, 2, [5, 6, 7, 8, 9])  # 3 blocks of 3: both cached ones go to the host tier
    offloads, promotions = tier.take_ops()
    assert sorted(d for d, _ in offloads) == sorted(device) and not promotions
    assert bm.prefix_cache.num_evictions == 2 and tier.num_blocks == 2
    hit = bm.match_prefix([1, 2, 3, 4, 7])
    assert hit.blocks == [] and len(hit.host_blocks) == 2 and hit.num_tokens == 4
    # Promotion: fresh device blocks (evicting the other prompt's blocks to the tier), copies queued.
    assert bm.can_admit(5, 5, hit)
    tier.settle()
    row = allocate(bm, 3, 5, hit)
    offloads, promotions = tier.take_ops()
    table = bm.rows.blocks_of(row)
    assert [h for h, _ in promotions] == hit.host_blocks and [d for _, d in promotions] == table[:2]
    assert tier.num_promotions == 2 and len(offloads) == 2  # (7, 8), then (5, 6): the other prompt's blocks
    # The promoted blocks are device nodes again: the next match finds them on the device.
    bm.cache_blocks(3, [1, 2, 3, 4, 7])
    assert bm.match_prefix([1, 2, 3, 4, 1]).blocks == table[:2]
    bm.free(3)
    np.testing.assert_array_equal(bm.refcount, 0)


def test_a_promotion_keeps_its_host_blocks_while_the_tier_is_full():
    # One tier block holds (1, 2); promoting it evicts a device block, whose offload finds the tier
    # full: the block being promoted must not be the one the tier gives up.
    bm = _tiered(num_blocks=4, tier=1)
    tier = bm.prefix_cache.host
    _serve(bm, 1, [1, 2, 3])
    _serve(bm, 2, [5, 6, 7, 8, 9, 10])  # three full blocks: (1, 2) goes to the tier
    (_, host), = tier.take_ops()[0]
    tier.settle()
    hit = bm.match_prefix([1, 2, 4])
    assert hit.host_blocks == [host]
    row = bm.admit(3, hit)
    offloads, promotions = tier.take_ops()
    assert promotions == [(host, bm.rows.blocks_of(row)[0])]
    assert offloads == []  # the evicted (9, 10) could not go to the tier: its one block is being read
    assert bm.match_prefix([1, 2, 0]).blocks == bm.rows.blocks_of(row)
    assert bm.match_prefix([5, 6, 7, 8, 9, 10, 0]).num_tokens == 4  # (9, 10) was dropped
    assert tier.num_blocks == 0 and bm.swap.num_free_blocks == 1


def test_swap_out_takes_back_the_tiers_blocks_never_a_swapped_one():
    bm = _tiered(num_blocks=5, tier=3, swap=1)
    tier = bm.prefix_cache.host
    _serve(bm, 1, [1, 2, 3, 4, 5, 6, 0])
    _serve(bm, 2, [7, 8, 9, 10, 11, 12, 13, 14])  # all four device blocks: (1..6) to the tier
    tier.take_ops()
    tier.settle()
    assert tier.num_blocks == 3 and bm.swap.num_unused_blocks == 1 and bm.swap.num_free_blocks == 4
    allocate(bm, 3, 7)  # 4 blocks: a group to preempt (its evictions replace the tier's blocks)
    tier.take_ops()
    tier.settle()
    assert tier.num_blocks == 3 and bm.swap.num_unused_blocks == 1
    assert bm.swap.can_swap_out([3])
    evictions = tier.num_evictions
    pairs = bm.swap.swap_out([3])
    assert len(pairs) == 4 and tier.num_blocks == 0 and tier.num_evictions == evictions + 3
    assert bm.swap.num_free_blocks == 0  # all four host blocks hold the swapped group
    _serve(bm, 4, [21, 22, 23, 24, 25, 26, 27, 28])
    allocate(bm, 5, 2)  # evicts a cached device block: no host block for it, it is dropped
    assert tier.take_ops() == ([], []) and tier.num_blocks == 0
    bm.free(5)
    bm.free(3)
    assert bm.swap.num_free_blocks == 4 and bm.swap.num_unused_blocks == 0  # free from the next step on
    tier.settle()
    assert bm.swap.num_unused_blocks == 4


def test_pinned_prefix_stays_and_its_partial_block_is_shared_copy_on_write():
    bm = BlockManager(6, 4, 0, 32, watermark=0.0, enable_prefix_caching=True)
    prefix = [1, 2, 3, 4, 5, 6]  # one full block and a partial one of 2 tokens
    allocate(bm, 1, len(prefix))
    bm.cache_blocks(1, prefix)
    pinned = bm.pin_prefix(1, prefix)
    assert pinned == bm.rows.blocks_of(bm.rows.row_of(1)) and bm.num_pinned_blocks == 2
    assert bm.pin_prefix(1, prefix) == pinned and bm.num_pinned_blocks == 2  # pinning again changes nothing
    bm.free(1)
    assert bm.num_free_blocks == 5 - 2 and not bm.fits(4 * 4)  # pins hold their blocks: never evicted
    hit = bm.match_prefix(prefix + [7, 8])
    assert hit.blocks == pinned and hit.partial and hit.num_tokens == 6
    assert bm.match_prefix(prefix).num_tokens == 4  # the prompt must go past the pinned tokens
    assert bm.match_prefix([1, 2, 3, 4, 5, 9, 9]).num_tokens == 4  # another continuation: full blocks only
    assert bm.match_prefix(prefix + [7], "salt").num_tokens == 0  # pins are per salt
    assert bm.can_admit(8, 8, hit)
    row = bm.admit(2, hit)
    slots, copies = bm.append_slots(np.array([row]), np.array([2]))
    own = bm.rows.blocks_of(row)[1]
    assert copies == [(pinned[1], own)] and slots.tolist() == [own * 4 + 2, own * 4 + 3]
    assert bm.refcount[pinned[1]] == 1  # the pin's reference only
    bm.free(2)
    assert bm.refcount[pinned].tolist() == [1, 1]
    with pytest.raises(ValueError, match="fewer than"):
        allocate(bm, 3, 3)
        bm.pin_prefix(3, [1, 2, 3, 4])


def test_pin_takes_the_trees_copies_and_adopts_what_it_lacks():
    bm = BlockManager(10, 4, 0, 40, watermark=0.0, enable_prefix_caching=True, num_host_cache_blocks=4)
    prefix = list(range(1, 9))  # two full blocks
    _serve(bm, 1, prefix)
    cached = [n.block for n in bm.prefix_cache.path([(1, 2, 3, 4), (5, 6, 7, 8)], None)]
    # A prompt of exactly the prefix recomputes its last block (a match never covers the last token):
    # its own copy is not the tree's, and the pin takes the tree's.
    allocate(bm, 2, 8, bm.match_prefix(prefix))
    bm.cache_blocks(2, prefix)
    own = bm.rows.blocks_of(bm.rows.row_of(2))[1]
    assert own != cached[1]
    assert bm.pin_prefix(2, prefix) == cached and bm.refcount[cached].tolist() == [2, 1]
    assert cached[1] not in bm.prefix_cache.evictable  # referenced by the pin now
    bm.free(2)
    assert bm.refcount[own] == 0 and bm.num_free_blocks == 9 - 2 and bm.num_pinned_blocks == 2
    # Pinning what the tree holds takes a reference, nothing else; a start of a pin shares its blocks.
    assert bm.pin_cached(prefix[:4]) == cached[:1] and bm.num_pinned_blocks == 2
    assert bm.refcount[cached].tolist() == [2, 1]
    assert bm.pin_cached(prefix + [9]) is None and bm.pin_cached([7, 7, 7, 7]) is None  # to compute first
    # A block the tree keeps in the host tier: the sequence's own copy becomes the node's, no copy back.
    _serve(bm, 3, [20, 21, 22, 23, 24, 25, 26, 27, 28])
    allocate(bm, 4, 28)  # 7 blocks: evicts the unpinned cached ones to the host tier
    bm.free(4)
    tier = bm.prefix_cache.host
    assert tier.num_blocks == 2
    other = [20, 21, 22, 23, 24, 25, 26, 27]
    allocate(bm, 5, 8, bm.match_prefix(other))  # its first block promoted, its last one its own
    blocks = bm.rows.blocks_of(bm.rows.row_of(5))
    assert [dst for _, dst in tier.take_ops()[1]] == blocks[:1] and tier.num_blocks == 1
    assert bm.pin_prefix(5, other) == blocks and tier.num_blocks == 0 and tier.take_ops() == ([], [])
    assert [n.block for n in bm.prefix_cache.path([(20, 21, 22, 23), (24, 25, 26, 27)], None)] == blocks
    bm.free(5)
    assert bm.num_pinned_blocks == 4 and bm.num_free_blocks == 9 - 4


def test_fit_rule_counts_only_the_pinned_blocks_a_prompt_does_not_share():
    bm = BlockManager(8, 4, 0, 40, watermark=0.0, enable_prefix_caching=True)
    prefix = list(range(1, 17))  # four full blocks: 3 of the 7 left
    allocate(bm, 1, 16)
    bm.cache_blocks(1, prefix)
    bm.pin_prefix(1, prefix)
    bm.free(1)
    sharing = prefix + [30, 31, 32, 33, 34]  # 6 blocks, 4 of them pinned and shared
    hits = bm.match_prefix(sharing)
    assert bm.num_shared_pinned(hits) == 4
    assert bm.fits(len(sharing) + 1, hits=hits) and not bm.fits(len(sharing) + 1)
    assert bm.fits(len(sharing) + 4, hits=hits) and not bm.fits(len(sharing) + 8, hits=hits)  # 3 own: fits; 4: not
    tail = prefix[:14]  # a pin ending inside a block: its partial block is copied when written
    allocate(bm, 2, 14, bm.match_prefix(tail))
    bm.cache_blocks(2, tail)
    bm.pin_prefix(2, tail)
    bm.free(2)
    assert bm.num_pinned_blocks == 5
    hits = bm.match_prefix(tail + [40, 41])
    assert hits.partial and bm.num_shared_pinned(hits) == 3


def test_no_swap_space_means_no_swap_out_even_with_a_host_tier():
    bm = BlockManager(8, 4, 0, 40, watermark=0.0, enable_prefix_caching=True, num_host_cache_blocks=4)
    allocate(bm, 1, 8)
    assert bm.swap.num_blocks == 4 and not bm.swap.can_swap_out([1])
    with pytest.raises(ValueError, match="no swap space"):
        bm.swap.swap_out([1])
    assert BlockManager(8, 4, 2, 40, enable_prefix_caching=True, num_host_cache_blocks=4).swap.swaps


def test_lru_policy_orders_by_release():
    policy = LRUPolicy()
    for block in (3, 1, 2):
        policy.add(block, reused=False)
    policy.add(3, reused=True)  # already queued: keeps its place
    policy.discard(1)
    assert [policy.victim(), policy.victim(), policy.victim()] == [3, 2, None]


def test_arc_policy_prefers_reused_blocks_and_adapts_to_ghost_hits():
    policy = ARCPolicy(capacity=4)
    policy.add(1, reused=False)
    policy.add(2, reused=True)
    policy.add(3, reused=False)
    assert policy.victim() == 1  # T1 over its target (0): once-used blocks go first
    policy.left(101, reused=False)
    assert policy.victim() == 3
    policy.left(103, reused=False)
    assert policy.victim() == 2 and policy.victim() is None
    policy.left(102, reused=True)
    policy.entered(101)  # evicted from T1 and wanted again: T1's target grows
    assert policy.target == 1
    policy.add(4, reused=False)
    policy.add(5, reused=True)
    assert policy.victim() == 5  # T1 (one block) within its target: T2 gives the victim
    policy.entered(102)  # a reused block's ghost: the target shrinks back
    assert policy.target == 0
    with pytest.raises(ValueError, match="eviction_policy"):
        make_policy("fifo", 4)


def test_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="num_host_cache_blocks"):
        BlockManager(4, 2, 0, 16, num_host_cache_blocks=2)
