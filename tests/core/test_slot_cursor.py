"""The paged decode cursor against the generic one (`append_slots` each step) on twin block managers.

Both cursors must hand out the same arrays step after step (positions, slots, context lengths,
block tables, padding zero) and leave the managers in the same state, through block boundaries,
rows that join and leave in place between steps (admissions, finishes, preemptions) and a pool
that runs dry (None, nothing changed).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.core.kv.block_manager import BlockManager
from jpaged.core.kv.slot_cursor import AppendCursor, PagedDecodeCursor
from jpaged.core.padding import bucket
from tests.helpers.kv import allocate


def _twins(block_size: int, num_blocks: int, lengths: list[int], prefix_caching: bool):
    managers = [BlockManager(num_blocks, block_size, 0, 128 * block_size, watermark=0.0, max_seqs=32,
                             enable_prefix_caching=prefix_caching) for _ in range(2)]
    rows = [[allocate(bm, i, n) for i, n in enumerate(lengths)] for bm in managers]
    if prefix_caching:  # cached, unreferenced blocks: opening a block then evicts them
        for bm in managers:
            extra = allocate(bm, 1000, 2 * block_size)
            bm.cache_blocks(1000, list(range(2 * block_size)))
            bm.free(1000)
            assert extra and bm.prefix_cache.num_evictable == 2
    assert rows[0] == rows[1]
    return managers, rows[0]


def _manager_state(bm: BlockManager):
    rows = bm.rows
    return (rows.block_tables.copy(), bm.refcount.copy(), rows.num_tokens.copy(), rows.num_table_blocks.copy(),
            list(bm._free), bm.num_free_blocks)


def _assert_same_step(paged, generic):
    assert (paged is None) == (generic is None)
    if paged is not None:
        np.testing.assert_array_equal(paged[0], generic[0])
        np.testing.assert_array_equal(paged[1], generic[1])


_events = st.lists(st.one_of(st.just(("step",)), st.tuples(st.just("remove"), st.integers(0, 40)),
                             st.tuples(st.just("add"), st.integers(1, 60))), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(block_size=st.sampled_from([1, 2, 3, 4, 16]), lengths=st.lists(st.integers(1, 40), max_size=9),
       events=_events, spare=st.integers(0, 30), prefix_caching=st.booleans())
def test_paged_cursor_matches_append_slots(block_size, lengths, events, spare, prefix_caching):
    need = sum(-(-n // block_size) for n in lengths) + sum(-(-e[1] // block_size) for e in events if e[0] == "add")
    (paged_bm, generic_bm), rows = _twins(block_size, need + spare + 4, lengths, prefix_caching)
    paged, generic = PagedDecodeCursor(paged_bm, rows), AppendCursor(generic_bm, rows)
    live = list(range(len(lengths)))  # seq id of each cursor row, in the cursors' order
    next_id = len(lengths)
    for event in events:
        if event[0] == "add":  # a sequence joins: admitted (its prompt's slots taken) the step before
            if paged_bm.rows.blocks_for(event[1]) > paged_bm.num_free_blocks:
                continue
            row = [allocate(bm, next_id, event[1]) for bm in (paged_bm, generic_bm)]
            assert row[0] == row[1]
            paged.add(row[0])
            generic.add(row[0])
            live.append(next_id)
            next_id += 1
            continue
        if event[0] == "remove":  # a sequence leaves (finished or preempted): its blocks go back
            if not live:
                continue
            i = event[1] % len(live)
            paged.remove(i)
            generic.remove(i)
            for bm in (paged_bm, generic_bm):
                bm.free(live[i])
            live[i] = live[-1]
            live.pop()
            continue
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
        n = len(live)
        assert state.shape[1] == tables.shape[0] == bucket(n)
        assert not state[:, n:].any() and not tables[n:].any()  # padding rows are zero
        rows_now = paged_bm.rows.rows_of(live)
        np.testing.assert_array_equal(state[2, :n], paged_bm.rows.num_tokens[rows_now])


def test_returned_arrays_are_never_written_again():
    (bm, _), rows = _twins(2, 60, [1, 2, 3], prefix_caching=False)
    cursor = PagedDecodeCursor(bm, rows)
    taken = [cursor.step() for _ in range(6)]
    cursor.add(allocate(bm, 10, 5))  # edits between steps touch only the cursor's own buffers
    taken.append(cursor.step())
    cursor.remove(0)
    copies = [(state.copy(), tables.copy()) for state, tables in taken]
    for _ in range(6):
        cursor.step()
    cursor.remove(1)
    cursor.add(allocate(bm, 11, 3))
    cursor.step()
    for (state, tables), (state_copy, tables_copy) in zip(taken, copies):
        np.testing.assert_array_equal(state, state_copy)
        np.testing.assert_array_equal(tables, tables_copy)


def test_tables_narrow_and_widen_with_the_longest_row():
    # Row 0 fills its 8th block with the first step and its next token opens a 9th; when it
    # leaves, the tables narrow to the rest's width; a long row joining widens them again.
    (paged_bm, generic_bm), rows = _twins(2, 60, [15, 3], prefix_caching=False)
    paged, generic = PagedDecodeCursor(paged_bm, rows), AppendCursor(generic_bm, rows)
    _assert_same_step(paged.step(), generic.step())
    assert paged.step()[1].shape[1] == 12 and generic.step()[1].shape[1] == 12
    paged.remove(0)
    generic.remove(0)
    got, want = paged.step(), generic.step()
    _assert_same_step(got, want)
    assert got[1].shape[1] == 8
    row = [allocate(bm, 5, 30) for bm in (paged_bm, generic_bm)]
    paged.add(row[0])
    generic.add(row[1])
    for _ in range(3):
        _assert_same_step(paged.step(), generic.step())
