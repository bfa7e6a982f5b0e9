"""Profiled mode: synthetic plans are well formed, the fit recovers a known linear cost, and the
SimExecutor runs on the fit; a slow test profiles the real JAX executor on a tiny model."""

import numpy as np
import pytest

from jpaged.executors.sim import SimExecutor
from jpaged.models.presets import get_preset
from jpaged.sim.cost_model import CostModel
from jpaged.sim.gpus import get_gpu
from jpaged.sim.profiled import FittedCostModel, profile, synthetic_plan

TINY = get_preset("tiny-opt")


def test_synthetic_plan_is_well_formed():
    plan = synthetic_plan(True, [5, 20], [5, 30], block_size=4, num_blocks=9, vocab_size=256)
    assert plan.padded_shape == (32, 8, 8) and plan.num_tokens == 25
    assert list(plan.query_start_loc[:3]) == [0, 5, 25]
    # Token 2 of sequence 1 sits at position 12: block table entry 3, offset 0.
    assert plan.positions[7] == 12 and plan.slot_mapping[7] == plan.block_tables[1, 3] * 4
    assert (plan.block_tables[:2] < 9).all() and plan.block_tables[0, 2:].sum() == 0
    assert list(plan.logits_indices[:2]) == [4, 24]
    decode = synthetic_plan(False, [1, 1, 1], [7, 8, 9], block_size=4, num_blocks=9, vocab_size=256)
    assert decode.padded_shape == (8, 8, 8) and list(decode.positions[:3]) == [6, 7, 8]
    with pytest.raises(ValueError, match="query_lens"):
        synthetic_plan(False, [2], [5], block_size=4, num_blocks=9, vocab_size=256)


def test_fit_recovers_a_known_linear_cost():
    def fake_execute(plan):  # 2 ms + 10 us/token + 1 ns/pair (prefill); 5 ms + 20 us/seq + 3 ns/ctx token
        n = plan.num_seqs
        q = np.diff(plan.query_start_loc[: n + 1]).astype(float)
        ctx = plan.context_lens[:n].astype(float)
        if plan.is_prefill:
            return 2e-3 + 1e-5 * q.sum() + 1e-9 * (q * (ctx - q) + q * (q + 1) / 2).sum()
        return 5e-3 + 2e-5 * n + 3e-9 * ctx.sum()

    samples = profile(fake_execute, block_size=16, num_blocks=512, vocab_size=256, repeats=1)
    fit = FittedCostModel(samples, CostModel(TINY, get_gpu("h200")))
    assert fit.decode_coef == pytest.approx([5e-3, 2e-5, 3e-9], rel=1e-6)
    assert fit.prefill_coef == pytest.approx([2e-3, 1e-5, 1e-9, 0.0], rel=1e-6, abs=1e-12)
    assert fit.decode_time(np.array([100, 300])) == pytest.approx(5e-3 + 4e-5 + 1.2e-6)
    ex = SimExecutor(TINY, fitted=fit)
    plan = synthetic_plan(False, [1] * 3, [50] * 3, block_size=16, num_blocks=512, vocab_size=256)
    assert ex.execute(plan).duration == pytest.approx(fake_execute(plan))
    with pytest.raises(ValueError, match="samples"):
        FittedCostModel(samples[:2], CostModel(TINY, get_gpu("h200")))


@pytest.mark.slow
def test_profile_the_real_jax_executor():
    from jpaged.config import CacheConfig, EngineConfig, ModelConfig
    from jpaged.executors.jax import JaxExecutor

    config = EngineConfig(model=ModelConfig(name="tiny-opt"), cache=CacheConfig(block_size=16, num_blocks=64))
    executor = JaxExecutor(config)
    samples = profile(lambda plan: executor.execute(plan).duration, block_size=16, num_blocks=64,
                      vocab_size=TINY.vocab_size, decode_batches=(1, 8), decode_contexts=(16, 128),
                      prefill_tokens=(16, 64, 128), repeats=2)
    fit = FittedCostModel(samples, CostModel(TINY, get_gpu("h200")))
    assert fit.decode_time(np.array([64])) > 0 and fit.prefill_time(np.array([64]), np.array([64])) > 0
