"""experiments.paged_batch.plan_from_contexts, plans built outside the scheduler: the StepPlan
contract's arrays and padding, the scheduler's bucket sizes by default, exact sizes on request, and
the shapes it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.paged_batch import plan_from_contexts
from jpaged.core.step_plan import StepPlan

# A prompt chunk (the last 5 of 8 tokens: 3 are cached) beside a decode (the 9th token), block size 4.
CONTEXTS = [[11, 12, 13, 14, 15, 16, 17, 18], list(range(20, 29))]
NUM_QUERY = [5, 1]
TABLES = [[3, 7], [4, 9, 2]]


def test_arrays_follow_the_contract_padded_as_the_scheduler_pads():
    plan = plan_from_contexts(CONTEXTS, NUM_QUERY, TABLES, 4)
    assert plan.padded_shape == (8, 8, 8)  # T: bucket(6), S: bucket(2), M: bucket(3)
    assert (plan.num_seqs, plan.num_tokens, plan.max_query_len, plan.num_prefill_tokens) == (2, 6, 5, 5)
    assert plan.sampling is None and not plan.has_block_ops
    np.testing.assert_array_equal(plan.token_ids, [14, 15, 16, 17, 18, 28] + [0] * 2)
    np.testing.assert_array_equal(plan.positions, [3, 4, 5, 6, 7, 8] + [0] * 2)
    # slot = table[pos // 4] * 4 + pos % 4; padded tokens write into reserved block 0.
    np.testing.assert_array_equal(plan.slot_mapping, [15, 28, 29, 30, 31, 8] + [0] * 2)
    np.testing.assert_array_equal(plan.query_start_loc, [0, 5, 6, 6, 6, 6, 6, 6, 6])
    np.testing.assert_array_equal(plan.context_lens, [8, 9, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(plan.logits_indices, [4, 5, 0, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(plan.block_tables[:2, :3], [[3, 7, 0], [4, 9, 2]])
    assert not plan.block_tables[2:].any() and not plan.block_tables[:, 3:].any()
    np.testing.assert_array_equal(plan.query_lens, NUM_QUERY)
    arrays = plan.device_arrays()
    assert tuple(arrays) == StepPlan.DEVICE_ARRAYS
    assert all(a.dtype == np.int32 for a in arrays.values())


def test_exact_shape_and_the_decode_only_shape():
    exact = plan_from_contexts(CONTEXTS, NUM_QUERY, TABLES, 4, shape=(7, 3, 4))
    assert exact.padded_shape == (7, 3, 4)
    np.testing.assert_array_equal(exact.query_start_loc, [0, 5, 6, 6])
    decode = plan_from_contexts(CONTEXTS, [1, 1], TABLES, 4)
    assert decode.padded_shape == (8, 8, 8) and decode.max_query_len == 1
    np.testing.assert_array_equal(decode.slot_mapping[:2], [31, 8])
    assert decode.num_prefill_tokens == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"shape": (5, 2, 3)}, "shape"),  # fewer token rows than tokens
    ({"shape": (6, 2, 2)}, "shape"),  # a table column short
    ({"num_query": [9, 1]}, "num_query"),  # more query tokens than context
    ({"tables": [[3], [4, 9, 2]]}, "tables"),  # a table too short for its context
    ({"num_query": [5]}, "as many"),
])
def test_refuses_shapes_that_cannot_hold_the_batch(kwargs, match):
    args = {"contexts": CONTEXTS, "num_query": NUM_QUERY, "tables": TABLES, "block_size": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        plan_from_contexts(**args)
