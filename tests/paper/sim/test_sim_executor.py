"""SimExecutor: step durations from the cost model, block ops, padding ignored, virtual clock."""

import dataclasses

import numpy as np
import pytest

from experiments.paged_batch import plan_from_contexts
from jpaged.config.presets import get_preset
from jpaged.core.step_plan import StepPlan, pairs_array
from jpaged.paper.sim.executor import SimExecutor
from jpaged.paper.sim.gpus import get_gpu

OPT13B = get_preset("opt-13b")
BLOCK_SIZE = 16


def make_plan(query_lens, context_lens, *, swap_out=(), swap_in=(), copies=()):
    """A padded StepPlan with the given real sequences (token ids and blocks are placeholders) and
    block operations."""
    if not query_lens:
        return StepPlan.block_ops_only(copy=copies, swap_in=swap_in, swap_out=swap_out)
    plan = plan_from_contexts([[0] * c for c in context_lens], query_lens,
                              [[1] * -(-c // BLOCK_SIZE) for c in context_lens], BLOCK_SIZE)
    return dataclasses.replace(plan, copy_pairs=pairs_array(copies), swap_in_pairs=pairs_array(swap_in),
                               swap_out_pairs=pairs_array(swap_out))


def test_prefill_and_decode_durations_match_the_cost_model():
    ex = SimExecutor(OPT13B, gpu="a100-40gb")
    cost = ex.cost_model
    result = ex.execute(make_plan([30, 70, 5], [30, 90, 5]))
    assert result.logprobs is None
    assert result.duration == pytest.approx(cost.prefill_time(np.array([30, 70, 5]), np.array([30, 90, 5])))
    decode = ex.execute(make_plan([1, 1, 1], [31, 91, 6]))
    assert decode.duration == pytest.approx(cost.decode_time(np.array([31, 91, 6])))
    mixed = ex.execute(make_plan([1, 1, 30], [31, 91, 40]))  # two decodes beside a prompt chunk
    assert mixed.duration == pytest.approx(cost.step_time(np.array([1, 1, 30]), np.array([31, 91, 40])))
    assert ex.now() == pytest.approx(result.duration + decode.duration + mixed.duration) == pytest.approx(ex.busy_s)
    assert ex.num_steps == 3


def test_block_ops_add_their_transfer_time():
    ex = SimExecutor(OPT13B, gpu=get_gpu("a100-40gb"))
    cost = ex.cost_model
    plan = make_plan([1], [40], swap_out=[(3, 0), (4, 1)], swap_in=[(2, 5)], copies=[(6, 7)])
    expected = cost.swap_time(2) + cost.swap_time(1) + cost.copy_time(1) + cost.decode_time(np.array([40]))
    assert ex.execute(plan).duration == pytest.approx(expected)
    only_swap = make_plan([], [], swap_out=[(1, 1)])
    assert ex.execute(only_swap).duration == pytest.approx(cost.swap_time(1))


def test_advance_to_moves_only_forward():
    ex = SimExecutor(OPT13B)
    ex.advance_to(5.0)
    assert ex.now() == 5.0 and ex.busy_s == 0.0
    ex.advance_to(2.0)
    assert ex.now() == 5.0


def test_deterministic_and_tensor_parallel():
    plans = [make_plan([100], [100]), make_plan([1], [101])]
    a, b = SimExecutor(OPT13B), SimExecutor(OPT13B)
    assert [a.execute(p).duration for p in plans] == [b.execute(p).duration for p in plans]
    tp2 = SimExecutor(get_preset("opt-66b"), gpu="a100-40gb", tp=4)
    assert tp2.execute(plans[1]).duration < 0.1
