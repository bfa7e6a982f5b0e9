"""Hypothesis state machine over the two-tier prefix cache: the block manager with a host tier and
pinned prefixes, driven step by step as the scheduler drives it, with the KV contents modelled.

A step runs the scheduler's phases: preemptions (swap-outs, or frees as recompute does), then
swap-ins, then admissions (prefix hits on the device, promotions from the host tier, pinned
partial blocks) and appends, in any mix, under two salts; then the step's copies run in the
executor's order (offloads, swap-outs, swap-ins and promotions, copy-on-write; each reads all its
sources before writing), then the model's writes. Between steps sequences finish and prefixes
are pinned. Memory is modelled slot by slot, so after every step the test checks what a
step could break: every resident or swapped sequence reads its own tokens, every cached block
(either tier) and pinned partial block holds its tokens, no hit crosses a salt, refcounts equal
table references plus pins, and both pools account for every block (free, referenced, cached,
held until the next step).
"""

from collections import Counter

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from jpaged.core.kv.block_manager import BlockManager

BS = 4
NUM_BLOCKS = 17
NUM_SWAP = 6
NUM_TIER = 5
MAX_LEN = 48
SALTS = (None, "x")
PREFIXES = ([], [1, 0, 1, 1, 0, 0, 1, 0, 1], [0, 0, 1, 1, 1, 0, 1, 0, 0, 1, 1, 0, 1])  # shared starts: hits
MAX_PINNED = 4  # pinned blocks never come back: at most these, or the pool is soon all pins


class TieredCacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.bm = None
        self.tokens: dict[int, list[int]] = {}  # seq -> tokens with slots (resident) or swapped
        self.salt: dict[int, object] = {}
        self.resident: set[int] = set()
        self.swapped: set[int] = set()
        self.dev: dict[int, int] = {}  # device slot -> token written there
        self.host: dict[int, int] = {}  # host slot -> token
        self.pins: list[tuple[object, list[int], list[int]]] = []  # (salt, tokens, blocks)
        self.next_id = 0

    @initialize(policy=st.sampled_from(["lru", "arc"]), tier=st.sampled_from([NUM_TIER, 1, 30]))
    def start(self, policy, tier):
        self.bm = BlockManager(NUM_BLOCKS, BS, NUM_SWAP, MAX_LEN, watermark=0.0, max_seqs=4,
                               enable_prefix_caching=True, num_host_cache_blocks=tier, eviction_policy=policy)

    # ------------------------------------------------------------------ one scheduler step

    @rule(data=st.data())
    def step(self, data):
        bm = self.bm
        swap_out, swap_in, copies, writes = [], [], [], []
        # 1. preemption: swap out, or free (recompute) whole sequences
        for seq in data.draw(st.lists(st.sampled_from(sorted(self.resident) or [0]), max_size=2, unique=True)):
            if seq not in self.resident:
                continue
            if data.draw(st.booleans()) and bm.swap.can_swap_out([seq]):
                swap_out += bm.swap.swap_out([seq])
                self.resident.discard(seq)
                self.swapped.add(seq)
            else:
                self._free(seq)
        # 2. swap-ins (none after a preemption, as the scheduler does)
        if not swap_out:
            for seq in data.draw(st.lists(st.sampled_from(sorted(self.swapped) or [0]), max_size=2, unique=True)):
                if seq in self.swapped and bm.swap.can_swap_in([seq]):
                    swap_in += bm.swap.swap_in([seq])
                    self.swapped.discard(seq)
                    self.resident.add(seq)
        # 3. admissions and appends, any mix
        for _ in range(data.draw(st.integers(0, 3))):
            if data.draw(st.booleans()) or not self.resident:
                prefix = data.draw(st.sampled_from(PREFIXES))
                prompt = prefix + data.draw(st.lists(st.integers(0, 1), min_size=1 - min(len(prefix), 1),
                                                     max_size=20 - len(prefix)))
                salt = data.draw(st.sampled_from(SALTS))
                self._admit(prompt, salt, copies, writes)
            else:
                seq = data.draw(st.sampled_from(sorted(self.resident)))
                new = data.draw(st.lists(st.integers(0, 1), min_size=1, max_size=5))
                self._append(seq, new, copies, writes)
        # 4. the executor: copies out, copies in, copy-on-write (each phase reads, then writes), the model
        offloads, promotions = bm.prefix_cache.host.take_ops()
        assert len({h for _, h in offloads}) == len(offloads), "two offloads into one host block"
        self._copy(self.dev, self.host, offloads)
        self._copy(self.dev, self.host, swap_out)
        self._copy(self.host, self.dev, swap_in + promotions)
        self._copy(self.dev, self.dev, copies)
        for slot, token in writes:
            self.dev[slot] = token
        bm.prefix_cache.host.settle()  # the next step begins
        self._check_contents()

    def _admit(self, prompt, salt, copies, writes):
        bm = self.bm
        hit = bm.match_prefix(prompt, salt)
        assert hit.num_tokens < len(prompt)
        self._check_salt(hit, salt)
        if not (bm.fits(len(prompt)) and bm.can_admit(len(prompt), len(prompt), hit)):
            return
        free_before = bm.num_free_blocks - sum(1 for b in hit.blocks if bm.refcount[b] == 0)  # hits stop being free
        seq = self._new_id()
        row = bm.admit(seq, hit)
        assert list(bm.rows.table(seq)[: len(hit.blocks)]) == hit.blocks
        result = bm.append_slots(np.array([row]), np.array([len(prompt) - hit.num_tokens]))
        assert result is not None, "can_admit promised room"
        slots, pairs = result
        assert free_before - bm.num_free_blocks == -(-len(prompt) // BS) - len(hit.blocks) + hit.partial
        copies += pairs
        writes += zip(slots.tolist(), prompt[hit.num_tokens:])
        self.tokens[seq], self.salt[seq] = list(prompt), salt
        self.resident.add(seq)
        bm.cache_blocks(seq, prompt, salt)

    def _append(self, seq, new, copies, writes):
        bm = self.bm
        if len(self.tokens[seq]) + len(new) > MAX_LEN:
            return
        result = bm.append_slots(bm.rows.rows_of([seq]), np.array([len(new)]))
        if result is None:
            return
        slots, pairs = result
        for slot in slots.tolist():
            assert bm.refcount[slot // BS] == 1, "an append writes into a shared block"
        copies += pairs
        writes += zip(slots.tolist(), new)
        self.tokens[seq] += new
        bm.cache_blocks(seq, self.tokens[seq], self.salt[seq])

    @staticmethod
    def _copy(src_mem, dst_mem, pairs):
        data = [[src_mem.get(src * BS + i) for i in range(BS)] for src, _ in pairs]  # every read first
        for (_, dst), values in zip(pairs, data):
            for i, value in enumerate(values):
                dst_mem[dst * BS + i] = value

    # ------------------------------------------------------------------ between steps

    @precondition(lambda self: self.resident or self.swapped)
    @rule(data=st.data())
    def finish(self, data):
        seq = data.draw(st.sampled_from(sorted(self.resident | self.swapped)))
        self._free(seq)

    @precondition(lambda self: self.resident and self.bm.num_pinned_blocks < MAX_PINNED)
    @rule(data=st.data())
    def pin(self, data):
        seq = data.draw(st.sampled_from(sorted(self.resident)))
        tokens = self.tokens[seq][: data.draw(st.integers(1, len(self.tokens[seq])))]
        known = any(s == self.salt[seq] and t == tokens for s, t, _ in self.pins)
        # (its full blocks are the tree's copies: another copy of cached ones, or its own joining the tree)
        blocks = self.bm.pin_prefix(seq, tokens, self.salt[seq])
        if not known:
            self.pins.append((self.salt[seq], tokens, blocks))
        assert self.bm.num_pinned_blocks == len({b for _, _, bs in self.pins for b in bs}), "pins counted twice"

    def _free(self, seq):
        if seq in self.resident:
            self.bm.cache_blocks(seq, self.tokens[seq], self.salt[seq])
        self.bm.free(seq)
        self.resident.discard(seq)
        self.swapped.discard(seq)

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    # ------------------------------------------------------------------ checks

    def _salt_blocks(self):
        """salt -> ({device blocks}, {host blocks}) of its tree."""
        out = {}
        for salt, root in self.bm.prefix_cache._roots.items():
            dev, host, stack = set(), set(), list(root.children.values())
            while stack:
                node = stack.pop()
                (host if node.on_host else dev).add(node.block)
                stack += node.children.values()
            out[salt] = (dev, host)
        return out

    def _check_salt(self, hit, salt):
        dev, host = self._salt_blocks().get(salt, (set(), set()))
        tails = {b for s, _, blocks in self.pins if s == salt for b in blocks}
        assert set(hit.blocks) <= dev | tails, "a hit reached another salt's device blocks"
        assert set(hit.host_blocks) <= host, "a hit reached another salt's host blocks"

    def _check_contents(self):
        bm = self.bm
        for seq in self.resident:
            table = bm.rows.table(seq).tolist()
            assert bm.rows.num_slots(seq) == len(self.tokens[seq])
            for p, token in enumerate(self.tokens[seq]):
                assert self.dev.get(table[p // BS] * BS + p % BS) == token, f"sequence {seq} reads a wrong token"
        for seq in self.swapped:
            host_blocks, num_tokens = bm.swap._tables[seq]
            assert num_tokens == len(self.tokens[seq])
            for p, token in enumerate(self.tokens[seq]):
                assert self.host.get(host_blocks[p // BS] * BS + p % BS) == token, "a swapped sequence lost a token"
        for root in bm.prefix_cache._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                if node.key is not None:
                    memory = self.host if node.on_host else self.dev
                    assert tuple(memory.get(node.block * BS + i) for i in range(BS)) == node.key, \
                        "a cached block lost its tokens"
                for tail, block in (node.tails or {}).items():
                    assert tuple(self.dev.get(block * BS + i) for i in range(len(tail))) == tail, \
                        "a pinned partial block was overwritten"
                stack += node.children.values()

    @invariant()
    def pools_are_consistent(self):
        bm = self.bm
        refs = Counter()
        for seq in self.resident:
            refs.update(bm.rows.table(seq).tolist())
        for _, _, blocks in self.pins:
            refs.update(blocks)
        expected = np.zeros(NUM_BLOCKS, np.int64)
        for block, count in refs.items():
            expected[block] = count
        np.testing.assert_array_equal(bm.refcount, expected)
        cache, tier = bm.prefix_cache, bm.prefix_cache.host
        free = set(bm._free)
        assert len(free) == len(bm._free) and 0 not in free and not free & set(refs)
        assert len(free) + len(refs) + cache.num_evictable == NUM_BLOCKS - 1
        # the tree: device nodes under device parents; host nodes held by the tier; cached xor referenced
        dev_nodes, host_nodes = [], []
        for root in cache._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                (host_nodes if node.on_host else dev_nodes).append(node)
                if not node.on_host:
                    assert node.parent.key is None or not node.parent.on_host, "a device node below a host node"
                    assert (bm.refcount[node.block] > 0) != (node.block in cache.evictable)
                assert node.parent.device_children == sum(not c.on_host for c in node.parent.children.values())
                stack += node.children.values()
        assert {n.block for n in dev_nodes} == set(cache._node_of_block) and not free & set(cache._node_of_block)
        assert sorted(n.block for n in host_nodes) == sorted(tier._node_of)
        assert tier.num_blocks <= tier.capacity
        swapped = Counter()
        for seq in self.swapped:
            swapped.update(bm.swap._tables[seq][0])
        host_free = bm.swap._free + bm.swap._settling
        assert len(set(host_free)) == len(host_free), "a host block is free twice"
        assert not set(host_free) & (set(swapped) | set(tier._node_of)) and not set(swapped) & set(tier._node_of)
        assert len(host_free) + len(swapped) + tier.num_blocks == NUM_SWAP + tier.capacity


TieredCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=25, deadline=None)
TestTieredCacheStateful = TieredCacheMachine.TestCase
