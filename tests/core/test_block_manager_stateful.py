"""Hypothesis state machine over the block manager: random allocate / append / verify / fork / free / swap.

Appends take one or several tokens per row (decodes and prompt chunks); forks share all blocks or
only a prefix of full ones (a recomputed group's sequences). A verify step (speculative decoding)
takes slots for k + 1 tokens and gives back those of the rejected drafts.

After every step: free + used = total on each pool, every refcount equals the number of tables
referencing the block, no block is both free and referenced, block 0 is never handed out, and no
append writes into a block that another table still references.
"""

from collections import Counter

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jpaged.core.kv.block_manager import BlockManager
from tests.helpers.kv import allocate

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
        if self.bm.fits(num_tokens) and self.bm.can_admit(num_tokens, num_tokens):
            seq = self._new_id()
            allocate(self.bm, seq, num_tokens)
            self.resident.add(seq)
            assert self.bm.rows.num_tokens[self.bm.rows.row_of(seq)] == num_tokens

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def append(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.resident)), min_size=1, max_size=4, unique=True))
        rows = self.bm.rows.rows_of(seqs)
        one_each = data.draw(st.booleans())
        counts = None if one_each else np.array(data.draw(st.lists(st.integers(1, 6), min_size=len(rows),
                                                                   max_size=len(rows))))
        pos = self.bm.rows.num_tokens[rows]
        end = pos + (1 if counts is None else counts)
        if (end > 48).any():
            return
        free_before = self.bm.num_free_blocks
        refcount_before = self.bm.refcount.copy()
        new_blocks = int((-(-end // BLOCK_SIZE) - -(-pos // BLOCK_SIZE)).sum())
        last = self.bm.rows.block_tables[rows, np.maximum(self.bm.rows.num_table_blocks[rows] - 1, 0)]
        shared_writes = int(((pos % BLOCK_SIZE != 0) & (refcount_before[last] > 1)).sum())
        result = self.bm.append_slots(rows, counts)
        if result is None:  # out of blocks: nothing may have changed
            assert new_blocks + shared_writes > free_before
            assert self.bm.num_free_blocks == free_before
            np.testing.assert_array_equal(self.bm.refcount, refcount_before)
            return
        slots, pairs = result
        assert len(slots) == int((end - pos).sum())
        for slot in slots.tolist():
            block = slot // BLOCK_SIZE
            assert block != 0
            assert self.bm.refcount[block] == 1, "append wrote into a shared block"
        for src, dst in pairs:
            assert self.bm.refcount[dst] == 1 and src != dst
        assert free_before - self.bm.num_free_blocks == new_blocks + len(pairs)

    @precondition(lambda self: self.resident)
    @rule(data=st.data(), k=st.integers(1, 5))
    def verify(self, data, k):
        """A verify step of speculative decoding: slots for a token and k drafts, then the
        rejected tail given back (`trim`): only the blocks the kept tokens need stay taken."""
        seq = data.draw(st.sampled_from(sorted(self.resident)))
        row = self.bm.rows.row_of(seq)
        pos = int(self.bm.rows.num_tokens[row])
        if pos + k + 1 > 48:
            return
        free_before = self.bm.num_free_blocks
        result = self.bm.append_slots(np.array([row]), np.array([k + 1]))
        if result is None:
            assert self.bm.num_free_blocks == free_before
            return
        slots, pairs = result
        for slot in slots.tolist():
            assert self.bm.refcount[slot // BLOCK_SIZE] == 1, "a draft was written into a shared block"
        accepted = data.draw(st.integers(0, k))
        self.bm.trim(seq, pos + 1 + accepted)
        kept = self.bm.rows.blocks_for(pos + 1 + accepted) - self.bm.rows.blocks_for(pos)
        assert free_before - self.bm.num_free_blocks == kept + len(pairs)
        assert self.bm.rows.num_slots(seq) == pos + 1 + accepted

    @precondition(lambda self: self.resident)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.resident)))
        full = self.bm.rows.num_slots(parent) // BLOCK_SIZE
        num_blocks = data.draw(st.one_of(st.none(), st.integers(0, full)))
        child = self._new_id()
        self.bm.fork(parent, child, num_blocks)
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
        if self.bm.swap.can_swap_out(seqs):
            pairs = self.bm.swap.swap_out(seqs)
            assert len({d for d, _ in pairs}) == len(pairs) == len({h for _, h in pairs})
            self.resident -= set(seqs)
            self.swapped |= set(seqs)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.swapped)), min_size=1, max_size=3, unique=True))
        if self.bm.swap.can_swap_in(seqs):
            self.bm.swap.swap_in(seqs)
            self.swapped -= set(seqs)
            self.resident |= set(seqs)

    @invariant()
    def pools_are_consistent(self):
        bm = self.bm
        refs = Counter()
        for seq in self.resident:
            table = bm.rows.table(seq)
            assert len(table) == bm.rows.blocks_for(bm.rows.num_slots(seq))
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
            host_refs.update(bm.swap._tables[seq][0])
        expected_host = np.zeros(NUM_HOST, dtype=np.int64)
        for block, count in host_refs.items():
            expected_host[block] = count
        np.testing.assert_array_equal(bm.swap.refcount, expected_host)
        host_free = set(bm.swap._free)
        assert len(host_free) == len(bm.swap._free) and not host_free & set(host_refs)
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
        hits = self.bm.match_prefix(prompt, salt)
        if self.bm.fits(len(prompt)) and self.bm.can_admit(len(prompt), len(prompt), hits):
            seq = self._new_id()
            allocate(self.bm, seq, len(prompt), hits)
            assert hits.num_tokens < len(prompt)
            assert list(self.bm.rows.table(seq)[: len(hits.blocks)]) == hits.blocks
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
            assert referenced != (block in cache.evictable), "cached blocks are referenced xor evictable"


PrefixCachingMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=30, deadline=None)
TestPrefixCachingStateful = PrefixCachingMachine.TestCase
