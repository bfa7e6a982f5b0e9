"""Buddy allocator: hand cases, a hypothesis state machine (no overlap, exact accounting,
coalescing back to the initial top blocks), and Orca's reservation policies."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from jpaged.paper.baselines.buddy import BuddyAllocator, order_of, reservation


def test_top_blocks_of_a_non_power_of_two_space():
    assert BuddyAllocator(13).free_blocks() == [(0, 8), (8, 4), (12, 1)]
    assert BuddyAllocator(16).free_blocks() == [(0, 16)]


def test_split_round_up_and_coalesce_by_hand():
    buddy = BuddyAllocator(16)
    a = buddy.allocate(3)  # rounds to 4: [0, 4), frees [4, 8) and [8, 16)
    assert a == 0 and buddy.allocated_size(a) == 4
    assert buddy.free_blocks() == [(4, 4), (8, 8)]
    b = buddy.allocate(1)  # lowest address of the smallest order that fits: splits [4, 8)
    assert b == 4 and buddy.free_blocks() == [(5, 1), (6, 2), (8, 8)]
    assert buddy.free_units == 11 and buddy.largest_free_block() == 8
    # A 4-unit request cannot use the 1 + 2 free units below 8.
    assert buddy.external_fragmentation(4) == 3 and buddy.external_fragmentation(2) == 1
    assert buddy.external_fragmentation(9) == 11  # nothing can serve 16 units now
    buddy.free(a)
    assert buddy.free_blocks() == [(0, 4), (5, 1), (6, 2), (8, 8)]  # [0,4) buddy [4,8) is split
    buddy.free(b)
    assert buddy.free_blocks() == [(0, 16)] and buddy.num_allocations == 0


def test_full_and_errors():
    buddy = BuddyAllocator(12)
    assert buddy.allocate(16) is None and not buddy.can_allocate(9)
    assert buddy.allocate(8) == 0 and buddy.allocate(4) == 8
    assert buddy.allocate(1) is None and buddy.free_units == 0 and buddy.largest_free_block() == 0
    with pytest.raises(ValueError, match="offset 3"):
        buddy.free(3)
    with pytest.raises(ValueError, match="size"):
        buddy.allocate(0)
    with pytest.raises(ValueError, match="num_units"):
        BuddyAllocator(0)


def test_reservation_policies_hand_cases():
    assert reservation("oracle", 100, 25) == 125
    assert reservation("pow2", 100, 25) == 132  # the paper's example: output 25 -> 32
    assert reservation("pow2", 100, 32) == 132  # already a power of two: no over-reservation
    assert reservation("pow2", 1000, 1000) == 2024  # 1000 -> 1024
    assert reservation("pow2", 500, 1500) == 2048  # 2048 + 500 capped at the max length
    assert reservation("max", 10, 5) == 2048 and reservation("max", 10, 5, max_len=1024) == 1024
    assert order_of(1) == 0 and order_of(25) == 5 and order_of(32) == 5
    with pytest.raises(ValueError, match="policy"):
        reservation("exact", 1, 1)
    with pytest.raises(ValueError, match="max_len"):
        reservation("oracle", 2000, 100)


NUM_UNITS = 45  # 32 + 8 + 4 + 1: four top blocks


class BuddyMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.buddy = BuddyAllocator(NUM_UNITS)
        self.initial = self.buddy.free_blocks()
        self.live: dict[int, int] = {}  # offset -> requested size

    @rule(size=st.integers(1, 40))
    def allocate(self, size):
        can = self.buddy.can_allocate(size)
        largest = self.buddy.largest_free_block()
        offset = self.buddy.allocate(size)
        assert (offset is not None) == can == (largest >= 1 << order_of(size))
        if offset is not None:
            assert offset % self.buddy.allocated_size(offset) == 0  # buddy blocks are aligned
            self.live[offset] = size

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        offset = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[offset]
        self.buddy.free(offset)

    @rule()
    def free_everything(self):
        for offset in list(self.live):
            self.buddy.free(offset)
        self.live.clear()
        assert self.buddy.free_blocks() == self.initial

    @invariant()
    def regions_tile_the_space_without_overlap(self):
        regions = [(off, self.buddy.allocated_size(off)) for off in self.live] + self.buddy.free_blocks()
        covered = [0] * NUM_UNITS
        for off, units in regions:
            for u in range(off, off + units):
                covered[u] += 1
        assert covered == [1] * NUM_UNITS

    @invariant()
    def accounting_is_exact(self):
        free = self.buddy.free_blocks()
        assert self.buddy.free_units == sum(units for _, units in free)
        assert self.buddy.largest_free_block() == max((units for _, units in free), default=0)
        for size in (1, 2, 3, 5, 8, 17, 33, 64):
            need = 1 << order_of(size)
            assert self.buddy.external_fragmentation(size) == sum(u for _, u in free if u < need)
        # No two free buddies of one order remain unmerged.
        for off, units in free:
            assert (off ^ units, units) not in free


TestBuddyMachine = BuddyMachine.TestCase
TestBuddyMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_many_operations_stay_fast_and_consistent():
    buddy, live = BuddyAllocator(15_728), []
    for i in range(20_000):
        if i % 3 != 2:
            offset = buddy.allocate(1 + (i * 7919) % 700)
            if offset is not None:
                live.append(offset)
        elif live:
            buddy.free(live.pop((i * 31) % len(live)))
    for offset in live:
        buddy.free(offset)
    assert buddy.free_blocks() == BuddyAllocator(15_728).free_blocks()
