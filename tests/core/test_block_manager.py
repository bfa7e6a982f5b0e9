"""Block manager: exact block counts after every operation, copy-on-write, swap, the fit rule, bad input."""

import numpy as np
import pytest

from jpaged.core.kv.block_manager import BlockManager
from tests.helpers.kv import allocate


def make(num_blocks=11, block_size=4, host=6, max_model_len=64, watermark=0.0):
    return BlockManager(num_blocks, block_size, host, max_model_len, watermark=watermark, max_seqs=2)


def test_allocate_append_free_exact_counts():
    bm = make()
    assert bm.num_free_blocks == 10  # block 0 reserved
    row = bm.admit(1)
    slots, pairs = bm.append_slots(np.array([row]), np.array([5]))  # 5 tokens -> 2 blocks
    assert bm.num_free_blocks == 8 and pairs == []
    assert 0 not in bm.rows.table(1)
    np.testing.assert_array_equal(slots, [bm.rows.table(1)[p // 4] * 4 + p % 4 for p in range(5)])
    rows = np.array([row])
    for expected_free in (8, 8, 8, 7):  # positions 5, 6, 7 fit in block 2's slots; 8 opens block 3
        slots, pairs = bm.append_slots(rows)
        assert pairs == []
        assert bm.num_free_blocks == expected_free
    assert bm.rows.num_tokens[row] == 9
    bm.free(1)
    assert bm.num_free_blocks == 10
    assert bm.refcount.sum() == 0


def test_num_slots_counts_each_sequence_s_scheduled_tokens():
    """num_slots is the scheduler's count of a sequence's computed tokens: the slots its row holds,
    through appends, partial forks, swaps and frees (0 whenever it holds no device row)."""
    bm = make()
    assert bm.rows.num_slots(1) == 0  # unknown
    row = bm.admit(1)
    assert bm.rows.num_slots(1) == 0
    bm.append_slots(np.array([row]), np.array([7]))
    assert bm.rows.num_slots(1) == 7  # (two blocks, one slot still free)
    bm.append_slots(np.array([row]))
    assert bm.rows.num_slots(1) == 8
    bm.fork(1, 2)
    bm.fork(1, 3, num_blocks=1)  # a recomputed sibling sharing one full block
    assert (bm.rows.num_slots(2), bm.rows.num_slots(3)) == (8, 4)
    bm.swap.swap_out([2])
    assert bm.rows.num_slots(2) == 0 and bm.swap.holds(2)
    bm.swap.swap_in([2])
    assert bm.rows.num_slots(2) == 8
    for seq_id in (1, 2, 3):
        bm.free(seq_id)
        assert bm.rows.num_slots(seq_id) == 0
    assert bm.num_free_blocks == 10 and not bm.refcount.any()


def test_fork_shares_and_copy_on_write():
    bm = make()
    allocate(bm, 1, 6)  # 2 blocks, last one half full
    bm.fork(1, 2)
    assert bm.num_free_blocks == 8
    shared_last = bm.rows.table(1)[-1]
    assert bm.refcount[shared_last] == 2
    slots, pairs = bm.append_slots(np.array([bm.rows.row_of(1), bm.rows.row_of(2)]))
    # The first writer copies; the second then owns the original alone and writes in place.
    assert len(pairs) == 1 and pairs[0][0] == shared_last
    assert bm.num_free_blocks == 7
    assert bm.refcount[shared_last] == 1 and bm.refcount[pairs[0][1]] == 1
    assert slots[0] // 4 != slots[1] // 4
    assert bm.rows.table(1)[0] == bm.rows.table(2)[0] and bm.refcount[bm.rows.table(1)[0]] == 2
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 10


def test_swap_out_and_in_keep_sharing():
    bm = make()
    allocate(bm, 1, 6)
    bm.fork(1, 2)
    assert bm.swap.can_swap_out([1, 2])
    pairs = bm.swap.swap_out([1, 2])
    assert len(pairs) == 2  # two distinct blocks, shared ones copied once
    assert bm.num_free_blocks == 10 and bm.swap.num_free_blocks == 4
    assert bm.swap.holds(1) and not bm.rows.has_seq(1)
    back = bm.swap.swap_in([1, 2])
    assert len(back) == 2 and bm.swap.num_free_blocks == 6 and bm.num_free_blocks == 8
    assert list(bm.rows.table(1)) == list(bm.rows.table(2))
    assert all(bm.refcount[b] == 2 for b in bm.rows.table(1))
    bm.free(1)
    bm.free(2)
    assert bm.num_free_blocks == 10


def test_can_admit_watermark_headroom_chunks_and_the_fit_rule():
    bm = make(num_blocks=11, watermark=0.2)  # 10 usable blocks, 2 of watermark
    assert bm.can_admit(4 * 8, 4 * 8)
    assert not bm.can_admit(4 * 9, 4 * 9)  # would eat into the watermark
    assert bm.can_admit(4 * 9, 4 * 9, headroom=0)  # nothing else runs: no headroom kept
    assert bm.can_admit(4 * 9, 4)  # a first chunk of one block
    assert bm.fits(4 * 10) and not bm.fits(4 * 11)  # more than the whole pool, chunked or not
    assert not bm.fits(4 * 9, extra_blocks=2)  # a recomputed group's other sequences' own blocks count
    allocate(bm, 1, 4 * 5)
    assert not bm.can_admit(4 * 4, 4 * 4)
    big = make(num_blocks=41)  # 40 usable blocks; a table holds 16 (max_model_len 64)
    assert big.fits(64) and not big.fits(65)  # longer than max_model_len: wider than the block table


def test_bad_input_raises_and_leaves_state_unchanged():
    bm = make(host=0)
    row = allocate(bm, 1, 5)
    before = (bm.num_free_blocks, bm.refcount.copy(), bm.rows.block_tables.copy())
    assert bm.append_slots(np.array([row]), np.array([40])) is None  # 10 more blocks, 8 free: nothing changes
    with pytest.raises(ValueError, match="max_model_len"):
        bm.append_row(row, 60)  # past the block table's width
    with pytest.raises(ValueError, match="already holds"):
        bm.admit(1)
    with pytest.raises(KeyError, match="unknown or already freed"):
        bm.free(7)
    with pytest.raises(ValueError, match="cannot fork onto"):
        bm.fork(1, 1)
    with pytest.raises(ValueError, match="no swap space"):
        bm.swap.swap_out([1])
    assert not bm.swap.can_swap_out([1])
    after = (bm.num_free_blocks, bm.refcount, bm.rows.block_tables)
    assert before[0] == after[0]
    np.testing.assert_array_equal(before[1], after[1])
    np.testing.assert_array_equal(before[2], after[2])
    bm.free(1)
    with pytest.raises(KeyError, match="already freed"):
        bm.free(1)


def test_rows_grow_beyond_initial_capacity():
    bm = make()
    for s in range(5):
        allocate(bm, s, 1)
    assert len({bm.rows.row_of(s) for s in range(5)}) == 5
    assert bm.num_free_blocks == 5


def test_partial_fork_shares_full_blocks_and_chunked_appends():
    bm = make(num_blocks=17)
    allocate(bm, 1, 10)  # blocks: 4 + 4 + 2
    row = bm.fork(1, 2, num_blocks=2)  # the 8 tokens of two full blocks
    assert bm.rows.num_tokens[row] == 8 and list(bm.rows.table(2)) == list(bm.rows.table(1)[:2])
    slots, pairs = bm.append_slots(np.array([bm.rows.row_of(1), row]), np.array([3, 5]))
    assert pairs == [] and len(slots) == 8  # positions 10..12 of seq 1, 8..12 of seq 2
    assert bm.rows.num_tokens[bm.rows.row_of(1)] == 13 and bm.rows.num_tokens[row] == 13
    assert bm.rows.table(2)[2] != bm.rows.table(1)[2]
    with pytest.raises(ValueError, match="full blocks"):
        bm.fork(1, 3, num_blocks=4)  # block 4 is not full


def test_swap_in_of_other_groupings_forgets_remembered_counts():
    """The swap space remembers how many blocks a set of sequences swapped out together holds; once
    any of them comes back (in whatever grouping), no remembered count names it any more."""
    bm = make(num_blocks=17, host=12)
    for seq in (1, 2, 3, 4):
        allocate(bm, seq, 1)
    bm.swap.swap_out([2])
    bm.swap.swap_out([3])
    bm.swap.swap_in([2, 3])  # back together: what was remembered of [2] and of [3] is stale now
    bm.append_slots(bm.rows.rows_of([3]), np.array([4]))  # sequence 3 grows to two blocks
    bm.swap.swap_out([3, 4])
    assert bm.swap.blocks_needed([3]) == 2
    allocate(bm, 5, 4 * (bm.num_free_blocks - 1))  # one free block left: not enough for sequence 3
    assert not bm.swap.can_swap_in([3])


def test_num_events_moves_with_every_block_event_and_not_with_appends():
    """The admission pass skips a held-back request until `num_events` moves: every event that can
    change its answer (admit, fork, free, swap out and in, cache inserts) must move it; a decode
    append must not, or the steady state would retry the queue's head every step."""
    bm = BlockManager(11, 4, 6, 64, watermark=0.0, max_seqs=2, enable_prefix_caching=True)
    seen = [bm.num_events]

    def moved() -> bool:
        seen.append(bm.num_events)
        return seen[-1] > seen[-2]

    row = allocate(bm, 1, 6)
    assert moved()
    bm.append_slots(np.array([row]))
    assert not moved()
    bm.cache_blocks(1, list(range(7)))
    assert moved()
    bm.fork(1, 2)
    assert moved()
    bm.swap.swap_out([1, 2])
    assert moved()
    bm.swap.swap_in([1, 2])
    assert moved()
    bm.free(2)
    assert moved()
    bm.swap.swap_out([1])
    bm.free(1)  # a swapped-out sequence's host blocks
    assert moved()
