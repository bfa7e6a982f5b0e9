"""PlanBuilder against a plain reference: any mix of a running batch's decodes (through its cursor),
decode segments and prompt chunks gives the arrays the StepPlan contract describes.

Reference, per sequence i with context e_i after the step and q_i new tokens: token rows
token_ids[e_i - q_i: e_i], positions e_i - q_i .. e_i - 1, slots through its block table,
query_start_loc the running sum of the q_i, context_lens e_i, logits_indices the last row of each
sequence; padding: token 0 at position 0 in reserved block 0, empty sequences with a zero table;
a step where every query is one token is decode-shaped (T == S).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.core.kv.block_manager import BlockManager
from jpaged.core.sched.persistent_batch import PersistentBatch
from jpaged.core.padding import bucket, seq_bucket
from jpaged.core.sched.plan_builder import PlanBuilder
from jpaged.core.sequence import SamplingParams, Sequence, SequenceGroup
from tests.helpers.kv import allocate


def _reference(bm: BlockManager, seqs, rows, counts):
    bs = bm.block_size
    tokens, positions, slots, qsl, ends = [], [], [], [0], []
    for seq, row, count in zip(seqs, rows, counts):
        end = int(bm.rows.num_tokens[row])
        for p in range(end - count, end):
            tokens.append(seq.token_ids[p])
            positions.append(p)
            slots.append(int(bm.rows.block_tables[row, p // bs]) * bs + p % bs)
        qsl.append(qsl[-1] + count)
        ends.append(end)
    return tokens, positions, slots, qsl, ends


@settings(max_examples=150, deadline=None)
@given(block_size=st.sampled_from([1, 4, 16]),
       decoding=st.lists(st.integers(1, 40), max_size=6),  # the running batch: context lengths
       chunks=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 40)), max_size=4),  # (cached, new tokens)
       one_token_decodes=st.integers(0, 3))
def test_plan_matches_reference(block_size, decoding, chunks, one_token_decodes):
    bm = BlockManager(2000, block_size, 0, 256, watermark=0.0, max_seqs=32)
    rng = np.random.default_rng(len(decoding) * 7 + len(chunks))
    seq_ids = iter(range(1000))

    def new_seq(length):
        seq = Sequence(next(seq_ids), rng.integers(1, 1000, length).tolist())
        SequenceGroup(str(seq.seq_id), [seq], SamplingParams(max_tokens=100), 0.0, seq.seq_id)
        return seq

    builder = PlanBuilder(bm)
    all_seqs, all_rows, all_counts = [], [], []
    if decoding:  # the batch's decodes lead, through its cursor
        seqs = [new_seq(n) for n in decoding]
        rows = np.array([allocate(bm, s.seq_id, len(s) - 1) if len(s) > 1 else bm.admit(s.seq_id) for s in seqs])
        batch = PersistentBatch(bm, seqs)
        builder.add_decodes(batch, *batch.step())
        all_seqs, all_rows, all_counts = list(seqs), list(rows), [1] * len(seqs)
    for _ in range(one_token_decodes):  # a decode segment of its own (a swapped-in group's, say)
        seq = new_seq(int(rng.integers(2, 30)))
        row = allocate(bm, seq.seq_id, len(seq) - 1)
        slots, copies = bm.append_slots(np.array([row]))
        builder.add([seq], np.array([row]), None, slots, copies)
        all_seqs.append(seq), all_rows.append(row), all_counts.append(1)
    for cached, count in chunks:  # prompt chunks: the next `count` tokens after `cached`
        seq = new_seq(cached + count + int(rng.integers(0, 5)))
        row = allocate(bm, seq.seq_id, cached) if cached else bm.admit(seq.seq_id)
        rows, counts = np.array([row]), np.array([count])
        slots, copies = bm.append_slots(rows, counts)
        builder.add([seq], rows, counts, slots, copies)
        all_seqs.append(seq), all_rows.append(row), all_counts.append(count)

    plan = builder.build(all_single=True)
    tokens, positions, slots, qsl, ends = _reference(bm, all_seqs, all_rows, all_counts)
    n, total = len(all_seqs), len(tokens)
    size_s = seq_bucket(n) if plan.max_query_len > 1 else bucket(n)
    assert (plan.num_seqs, plan.num_tokens, plan.seqs) == (n, total, all_seqs)
    assert plan.max_query_len == max(all_counts, default=0)
    T, S, M = plan.padded_shape
    assert S == size_s
    assert T == bucket(total)  # decodes and chunks alike
    np.testing.assert_array_equal(plan.token_ids, tokens + [0] * (T - total))
    np.testing.assert_array_equal(plan.positions, positions + [0] * (T - total))
    np.testing.assert_array_equal(plan.slot_mapping[:total], slots)
    assert (plan.slot_mapping[total:] < block_size).all()  # padding writes land in block 0
    np.testing.assert_array_equal(plan.query_start_loc, qsl + [total] * (S - n))
    np.testing.assert_array_equal(plan.context_lens, ends + [0] * (S - n))
    np.testing.assert_array_equal(plan.logits_indices[:n], np.array(qsl[1:]) - 1)
    if plan.max_query_len <= 1:
        assert M == min(bucket(-(-max(ends, default=1) // block_size)), bm.rows.max_blocks_per_seq)
    else:  # a step with a prompt chunk: the full width, S a power of two
        assert M == bm.rows.max_blocks_per_seq and S == max(8, 1 << (n - 1).bit_length())
    for i, row in enumerate(all_rows):
        used = -(-ends[i] // block_size)
        np.testing.assert_array_equal(plan.block_tables[i, :used], bm.rows.block_tables[row, :used])
    assert not plan.block_tables[n:].any()
    assert plan.num_prefill_tokens == sum(count for _, count in chunks)
    # Sampling: every sequence whose context reaches its end, once, reading its own logits row.
    sampling = [i for i, (seq, end) in enumerate(zip(all_seqs, ends)) if end == len(seq.token_ids)]
    if not sampling:
        assert plan.sampling is None
    else:
        assert plan.sampling.seqs == [all_seqs[i] for i in sampling]
        np.testing.assert_array_equal(plan.sampling.logits_rows, sampling)
    _check_ragged(plan, int(rng.integers(max(n, 1), 40)), bm.rows.max_blocks_per_seq)


def _check_ragged(plan, max_num_seqs: int, width: int) -> None:
    """The plan at the ragged shape of its T (what the executor runs) describes the same batch:
    the real sequences' rows as they were, padding sequences empty, tables at the full width."""
    ragged = plan.to_ragged(max_num_seqs, width)
    T, S, M = ragged.padded_shape
    assert (T, M) == (len(plan.token_ids), width) and S == min(1 << (T - 1).bit_length(), max_num_seqs)
    n, total = plan.num_seqs, plan.num_tokens
    np.testing.assert_array_equal(ragged.query_start_loc[: n + 1], plan.query_start_loc[: n + 1])
    assert (ragged.query_start_loc[n:] == total).all()  # padding sequences own no rows
    np.testing.assert_array_equal(ragged.context_lens[:n], plan.context_lens[:n])
    assert not ragged.context_lens[n:].any() and not ragged.block_tables[n:].any()
    np.testing.assert_array_equal(ragged.logits_indices[:n], plan.logits_indices[:n])
    cols = plan.block_tables.shape[1]
    np.testing.assert_array_equal(ragged.block_tables[:n, :cols], plan.block_tables[:n])
    assert not ragged.block_tables[:, cols:].any()
    assert ragged.to_ragged(max_num_seqs, width) is ragged
