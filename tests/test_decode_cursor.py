"""The paged decode cursor against the generic one (`append_slots` each step) on twin block managers.

Both cursors must hand out the same arrays step after step (positions, slots, context lengths,
block tables, padding zero) and leave the managers in the same state, through block boundaries,
a trimmed batch (a preempted tail, finished rows) and a pool that runs dry (None, nothing changed).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.block_manager import BlockManager
from jpaged.decode_batch import _padded
from jpaged.decode_cursor import AppendCursor, PagedDecodeCursor


def _twins(block_size: int, num_blocks: int, lengths: list[int], prefix_caching: bool):
    managers = [BlockManager(num_blocks, block_size, 0, 128 * block_size, watermark=0.0, max_seqs=32,
                             enable_prefix_caching=prefix_caching) for _ in range(2)]
    rows = [np.array([bm.allocate(i, n) for i, n in enumerate(lengths)], np.int64) for bm in managers]
    if prefix_caching:  # cached, unreferenced blocks: opening a block then evicts them
        for bm in managers:
            extra = bm.allocate(len(lengths), 2 * block_size)
            bm.cache_blocks(len(lengths), list(range(2 * block_size)))
            bm.free(len(lengths))
            assert extra and bm.prefix_cache.num_evictable == 2
    return managers, rows


def _manager_state(bm: BlockManager):
    return (bm.block_tables.copy(), bm.refcount.copy(), bm.num_tokens.copy(), bm.num_table_blocks.copy(),
            list(bm._free), bm.num_free_blocks)


def _assert_same_step(paged, generic):
    assert (paged is None) == (generic is None)
    if paged is not None:
        np.testing.assert_array_equal(paged[0], generic[0])
        np.testing.assert_array_equal(paged[1], generic[1])


@settings(max_examples=150, deadline=None)
@given(block_size=st.sampled_from([1, 2, 3, 4, 16]),
       lengths=st.lists(st.integers(1, 40), min_size=1, max_size=9),
       steps=st.integers(1, 40), trim_at=st.integers(0, 40), dropped=st.sets(st.integers(0, 8)),
       spare=st.integers(0, 30), prefix_caching=st.booleans())
def test_paged_cursor_matches_append_slots(block_size, lengths, steps, trim_at, dropped, spare, prefix_caching):
    need = sum(-(-n // block_size) for n in lengths)
    (paged_bm, generic_bm), (rows, _) = _twins(block_size, need + spare + 4, lengths, prefix_caching)
    padded = _padded(rows)
    paged, generic = PagedDecodeCursor(paged_bm, rows, padded), AppendCursor(generic_bm, rows, padded)
    for step in range(steps):
        keep = np.array([i for i in range(len(rows)) if i not in dropped], np.int64)
        if step == trim_at and 0 < len(keep) < len(rows):  # rows leave (a preempted tail, finished ones)
            rows = rows[keep]
            padded = _padded(rows)
            paged, generic = paged.kept(keep, padded), generic.kept(keep, padded)
        before = _manager_state(paged_bm)
        got, want = paged.step(), generic.step()
        _assert_same_step(got, want)
        for a, b in zip(_manager_state(paged_bm), _manager_state(generic_bm)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        if got is None:  # out of blocks: nothing changed, and it stays so
            for a, b in zip(before, _manager_state(paged_bm)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            break
        state, tables = got
        assert not state[:, len(rows):].any() and not tables[len(rows):].any()  # padding rows are zero


def test_returned_arrays_are_never_written_again():
    (bm, _), (rows, _) = _twins(2, 40, [1, 2, 3], prefix_caching=False)
    cursor = PagedDecodeCursor(bm, rows, _padded(rows))
    taken = [cursor.step() for _ in range(6)]
    copies = [(state.copy(), tables.copy()) for state, tables in taken]
    for _ in range(6):
        cursor.step()
    for (state, tables), (state_copy, tables_copy) in zip(taken, copies):
        np.testing.assert_array_equal(state, state_copy)
        np.testing.assert_array_equal(tables, tables_copy)


def test_trimmed_cursor_widens_for_a_row_about_to_open_a_block():
    # Row 0 fills its 8th block with the first step; its next token opens a 9th, which the
    # trimmed cursor's tables (bucketed: 12 columns) must have room for at once.
    (paged_bm, generic_bm), (rows, _) = _twins(2, 40, [15, 3], prefix_caching=False)
    paged, generic = PagedDecodeCursor(paged_bm, rows, _padded(rows)), AppendCursor(generic_bm, rows, _padded(rows))
    _assert_same_step(paged.step(), generic.step())
    assert paged._tables.shape[1] == 8  # (bucketed to the 8 blocks it used so far)
    kept, keep = _padded(rows[:1]), np.array([0], np.int64)
    paged, generic = paged.kept(keep, kept), generic.kept(keep, kept)
    for _ in range(3):
        _assert_same_step(paged.step(), generic.step())
