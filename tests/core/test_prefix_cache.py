"""Prefix cache: matching, LRU eviction of unreferenced leaves, salts, and the block manager around it."""

import numpy as np
import pytest

from jpaged.core.kv.block_manager import BlockManager
from jpaged.core.kv.eviction import LRUPolicy
from jpaged.core.kv.prefix_cache import PrefixCache, block_keys
from tests.helpers.kv import allocate


def test_match_insert_and_lru_eviction_of_leaves():
    cache = PrefixCache(2, LRUPolicy())
    cache.insert(block_keys([1, 2, 3, 4, 5, 6], 2), [10, 11, 12], salt=None)
    cache.insert(block_keys([1, 2, 7, 8], 2), [10, 20], salt=None)
    assert cache.match(block_keys([1, 2, 3, 4, 5, 6, 9], 2), None, max_blocks=3).blocks == [10, 11, 12]
    assert cache.match(block_keys([1, 2, 7, 8], 2), None, max_blocks=1).blocks == [10]
    assert cache.match(block_keys([9, 9], 2), None, max_blocks=1).blocks == []
    assert cache.release_all([10, 11, 12, 20, 7]) == [7]  # 7 is not cached: the caller frees it
    cache.touch([10, 11, 12])  # the 1-2-3-4-5-6 branch is now more recent than 1-2-7-8
    cache.release_all([10, 11, 12])
    cache.touch([12])  # a live sequence holds block 12 again
    assert cache.evict() == 20  # LRU leaf first
    assert cache.evict() is None  # 12 is referenced; 11 and 10 are not leaves
    assert cache.num_cached_blocks == 3 and cache.num_evictions == 1


def test_salts_never_share():
    cache = PrefixCache(2, LRUPolicy())
    cache.insert(block_keys([1, 2, 3, 4], 2), [5, 6], salt="tenant-a")
    assert cache.match(block_keys([1, 2, 3, 4, 9], 2), "tenant-a", 2).blocks == [5, 6]
    assert cache.match(block_keys([1, 2, 3, 4, 9], 2), "tenant-b", 2).blocks == []
    assert cache.match(block_keys([1, 2, 3, 4, 9], 2), None, 2).blocks == []


def test_block_manager_shares_cached_prefix_and_evicts_when_needed():
    bm = BlockManager(9, 4, 0, 64, watermark=0.0, enable_prefix_caching=True)
    prompt = list(range(100, 110))  # 10 tokens: 2 full blocks + 2 tokens
    assert bm.match_prefix(prompt).num_tokens == 0
    allocate(bm, 1, len(prompt))
    bm.cache_blocks(1, prompt)
    hits = bm.match_prefix(prompt + [7])
    allocate(bm, 2, len(prompt) + 1, hits)
    assert hits.num_blocks == 2 and list(bm.rows.table(2)[:2]) == list(bm.rows.table(1)[:2]) == hits.blocks
    assert all(bm.refcount[b] == 2 for b in bm.rows.table(1)[:2])
    assert bm.num_free_blocks == 8 - 4  # 2 shared blocks + a tail block each
    bm.free(1)
    bm.free(2)
    # The two prompt blocks stay cached (evictable); everything counts as free.
    assert bm.num_free_blocks == 8 and bm.prefix_cache.num_evictable == 2
    # A never-100% hit: a prompt of exactly 2 cached blocks recomputes its last block.
    hits = bm.match_prefix(prompt[:8])
    assert hits.num_tokens == 4 and bm.can_admit(8, 8, hits)
    allocate(bm, 3, 8, hits)
    # Fill the pool: the unreferenced cached block is evicted last, referenced ones never.
    allocate(bm, 4, 4 * 6)
    assert bm.num_free_blocks == 0
    assert bm.prefix_cache.num_evictions == 1
    assert not bm.can_admit(1, 1)
    with pytest.raises(RuntimeError, match="out of device blocks"):
        bm.take_block()
    bm.free(3)
    bm.free(4)
    assert bm.num_free_blocks == 8
    np.testing.assert_array_equal(bm.refcount, 0)
