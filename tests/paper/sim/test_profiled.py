"""Profiled mode: the fit recovers a known linear cost of any batch mix (timed on the experiment's
grid), and the SimExecutor runs on the fit; a slow test profiles the real JAX executor on a tiny model."""

import numpy as np
import pytest

from experiments.bench.profile_executor import profile, synthetic_plan
from jpaged.config.presets import get_preset
from jpaged.paper.sim.cost_model import CostModel
from jpaged.paper.sim.executor import SimExecutor
from jpaged.paper.sim.gpus import get_gpu
from jpaged.paper.sim.profiled import FittedCostModel

TINY = get_preset("tiny-opt")


def fake_execute(plan):
    """A known cost: 5 ms decode-only / 2 ms with a prefill row; 20 us per decode row and 3 ns per
    decode context token; 10 us per prefill token and 1 ns per attention pair."""
    n = plan.num_seqs
    q = np.diff(plan.query_start_loc[: n + 1]).astype(float)
    ctx = plan.context_lens[:n].astype(float)
    decode = q == 1
    qp, cp = q[~decode], ctx[~decode]
    fixed = 2e-3 if (~decode).any() else 5e-3
    return (fixed + 2e-5 * decode.sum() + 3e-9 * ctx[decode].sum()
            + 1e-5 * qp.sum() + 1e-9 * (qp * (cp - qp) + qp * (qp + 1) / 2).sum())


def test_fit_recovers_a_known_linear_cost():
    samples = profile(fake_execute, block_size=16, num_blocks=512, vocab_size=256, repeats=1)
    fit = FittedCostModel(samples, CostModel(TINY, get_gpu("h200")))
    assert fit.coef == pytest.approx([5e-3, 2e-3, 2e-5, 3e-9, 1e-5, 1e-9, 0.0], rel=1e-6, abs=1e-12)
    assert fit.decode_time(np.array([100, 300])) == pytest.approx(5e-3 + 4e-5 + 1.2e-6)
    # A mixed step: two decode rows beside a 30-token chunk after 10 cached tokens.
    mixed = fit.step_time(np.array([1, 1, 30]), np.array([100, 300, 40]))
    assert mixed == pytest.approx(2e-3 + 4e-5 + 1.2e-6 + 3e-4 + 1e-9 * (30 * 10 + 30 * 31 / 2))
    ex = SimExecutor(TINY, fitted=fit)
    for q, ctx in (([1] * 3, [50] * 3), ([1, 1, 30], [100, 300, 40])):
        plan = synthetic_plan(q, ctx, block_size=16, num_blocks=512, vocab_size=256)
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
    assert fit.decode_time(np.array([64])) > 0 and fit.step_time(np.array([1, 64]), np.array([9, 64])) > 0
