"""StepPlan.block_ops_only, the plan of a step that runs no sequence, only block copies: its pairs
and the smallest bucket shape of the StepPlan contract's arrays."""

from __future__ import annotations

import numpy as np

from jpaged.core.step_plan import StepPlan


def test_block_ops_only_runs_no_sequence():
    plan = StepPlan.block_ops_only(copy=[(1, 2)], swap_out=[(3, 0), (4, 1)])
    assert plan.num_seqs == 0 and plan.has_block_ops and plan.num_tokens == 0
    np.testing.assert_array_equal(plan.copy_pairs, [[1, 2]])
    np.testing.assert_array_equal(plan.swap_out_pairs, [[3, 0], [4, 1]])
    assert plan.swap_in_pairs.shape == (0, 2)
    assert not plan.context_lens.any() and not plan.query_start_loc.any()
    assert all(a.dtype == np.int32 for a in plan.device_arrays().values())
