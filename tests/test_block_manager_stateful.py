"""Hypothesis state machine over the block manager: random allocate / append / fork / free / swap.

After every step: free + used = total on each pool, every refcount equals the number of tables
referencing the block, no block is both free and referenced, block 0 is never handed out, and no
append writes into a block that another table still references.
"""

from collections import Counter

import numpy as np
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jpaged.block_manager import AllocStatus, BlockManager

BLOCK_SIZE = 4
NUM_BLOCKS = 17
NUM_HOST = 12


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, NUM_HOST, max_model_len=48, watermark=0.0, max_seqs=2)
        self.resident: set[int] = set()
        self.swapped: set[int] = set()
        self.next_id = 0

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    @rule(num_tokens=st.integers(1, 40))
    def allocate(self, num_tokens):
        status = self.bm.can_allocate(num_tokens)
        if status is AllocStatus.OK:
            seq = self._new_id()
            self.bm.allocate(seq, num_tokens)
            self.resident.add(seq)
            assert self.bm.num_tokens[self.bm.row_of(seq)] == num_tokens

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def append(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.resident)), min_size=1, max_size=4, unique=True))
        rows = np.array([self.bm.row_of(s) for s in seqs])
        if (self.bm.num_tokens[rows] >= 48).any():
            return
        free_before = self.bm.num_free_blocks
        refcount_before = self.bm.refcount.copy()
        bound = self.bm.blocks_needed_to_append(rows)
        surely = self.bm.can_append_slots(rows)
        result = self.bm.append_slots(rows)
        if result is None:  # out of blocks: nothing may have changed
            assert not surely
            assert self.bm.num_free_blocks == free_before
            np.testing.assert_array_equal(self.bm.refcount, refcount_before)
            return
        slots, pairs = result
        for slot in slots.tolist():
            block = slot // BLOCK_SIZE
            assert block != 0
            assert self.bm.refcount[block] == 1, "append wrote into a shared block"
        for src, dst in pairs:
            assert self.bm.refcount[dst] == 1 and src != dst
        assert free_before - self.bm.num_free_blocks <= bound

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.resident)))
        child = self._new_id()
        self.bm.fork(parent, child)
        self.resident.add(child)

    @precondition(lambda self: self.resident or self.swapped)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.resident | self.swapped)))
        self.bm.free(seq)
        self.resident.discard(seq)
        self.swapped.discard(seq)

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def swap_out(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.resident)), min_size=1, max_size=3, unique=True))
        if self.bm.can_swap_out(seqs):
            pairs = self.bm.swap_out(seqs)
            assert len({d for d, _ in pairs}) == len(pairs) == len({h for _, h in pairs})
            self.resident -= set(seqs)
            self.swapped |= set(seqs)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.swapped)), min_size=1, max_size=3, unique=True))
        if self.bm.can_swap_in(seqs):
            self.bm.swap_in(seqs)
            self.swapped -= set(seqs)
            self.resident |= set(seqs)

    @invariant()
    def pools_are_consistent(self):
        bm = self.bm
        refs = Counter()
        for seq in self.resident:
            table = bm.block_table(seq)
            assert len(table) == bm.blocks_for(int(bm.num_tokens[bm.row_of(seq)]))
            assert len(set(table.tolist())) == len(table)
            refs.update(table.tolist())
        assert 0 not in refs and bm.refcount[0] == 0
        expected = np.zeros(NUM_BLOCKS, dtype=np.int64)
        for block, count in refs.items():
            expected[block] = count
        np.testing.assert_array_equal(bm.refcount, expected)
        free = set(bm._free)
        assert len(free) == len(bm._free), "a block is on the free list twice"
        assert 0 not in free
        assert not free & set(refs), "a block is both free and referenced"
        evictable = bm.prefix_cache.num_evictable if bm.prefix_cache is not None else 0
        assert len(free) + len(refs) + evictable == NUM_BLOCKS - 1

        host_refs = Counter()
        for seq in self.swapped:
            host_refs.update(bm._host_tables[seq][0])
        expected_host = np.zeros(NUM_HOST, dtype=np.int64)
        for block, count in host_refs.items():
            expected_host[block] = count
        np.testing.assert_array_equal(bm.host_refcount, expected_host)
        host_free = set(bm._host_free)
        assert len(host_free) == len(bm._host_free) and not host_free & set(host_refs)
        assert len(host_free) + len(host_refs) == NUM_HOST


BlockManagerMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=30, deadline=None)
TestBlockManagerStateful = BlockManagerMachine.TestCase


class PrefixCachingMachine(BlockManagerMachine):
    """The same machine with prefix caching: prompts from a tiny alphabet, so prefixes repeat."""

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, NUM_HOST, max_model_len=48, watermark=0.0,
                               max_seqs=2, enable_prefix_caching=True)
        self.tokens: dict[int, list[int]] = {}

    @rule(data=st.data(), salt=st.sampled_from([None, "x"]))
    def allocate_with_prefix(self, data, salt):
        prompt = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=20))
        if self.bm.can_allocate(len(prompt), token_ids=prompt, cache_salt=salt) is AllocStatus.OK:
            seq = self._new_id()
            _, cached = self.bm.allocate_with_prefix(seq, prompt, salt)
            assert cached % BLOCK_SIZE == 0 and cached < len(prompt)
            self.bm.cache_blocks(seq, prompt, salt)
            self.resident.add(seq)

    @invariant()
    def cache_is_consistent(self):
        cache = self.bm.prefix_cache
        free = set(self.bm._free)
        tree_blocks = []
        stack = list(cache._roots.values())
        while stack:
            node = stack.pop()
            for child in node.children.values():
                tree_blocks.append(child.block)
                stack.append(child)
        assert len(tree_blocks) == len(set(tree_blocks)), "a block sits in two tree nodes"
        assert set(tree_blocks) == set(cache._node_of_block)
        assert not free & set(tree_blocks), "a block is both free and in the tree"
        for block in tree_blocks:
            referenced = self.bm.refcount[block] > 0
            assert referenced != (block in cache._evictable), "cached blocks are referenced xor evictable"


PrefixCachingMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
TestPrefixCachingStateful = PrefixCachingMachine.TestCase
