"""The paged engine's greedy outputs equal a dense-cache decode of the same model, preempted or not."""

import pytest

from jpaged.core.sequence import SamplingParams
from tests.helpers.tiny_engines import dense_greedy, make_engine

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def reference():
    import numpy as np
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, size=n).tolist() for n in (3, 8, 9, 17, 30, 5, 41, 12)]
    return prompts, dense_greedy("tiny-opt", prompts, MAX_TOKENS)


def _run(engine, prompts):
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.output_token_ids[0] for o in outs]


def test_greedy_matches_dense(reference):
    prompts, expected = reference
    engine = make_engine()
    assert _run(engine, prompts) == expected
    stats = engine.kv_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_preemptions"] == 0


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_greedy_matches_dense_under_preemption(reference, mode, block_size):
    prompts, expected = reference
    # 53 prompt + output tokens at most per request; a pool of ~2 requests forces many preemptions.
    engine = make_engine(block_size=block_size, num_blocks=1 + 128 // block_size, preemption_mode=mode)
    assert _run(engine, prompts) == expected
    stats = engine.kv_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_host_blocks"]


def test_recompute_past_the_token_budget_still_progresses():
    """A preempted request whose prompt + outputs exceed max_num_batched_tokens is re-admitted alone."""
    from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from jpaged.engine import LLMEngine
    from jpaged.executors.jax import JaxExecutor

    prompts = [list(range(1, 9)), list(range(50, 90))]  # 8 and 40 tokens
    max_tokens = [60, 30]
    config = EngineConfig(model=ModelConfig(name="tiny-opt", attention_backend="xla"),
                          cache=CacheConfig(block_size=8, num_blocks=13, num_host_blocks=0, watermark=0.0),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=48, max_model_len=128,
                                                    preemption_mode="recompute"))
    engine = LLMEngine(config, executor=JaxExecutor(config))
    for i, (p, n) in enumerate(zip(prompts, max_tokens)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n))
    outputs = {}
    for _ in range(200):  # bounded: without progress the engine would spin forever
        outputs.update({o.request_id: o for o in engine.step()})
        if not engine.has_unfinished():
            break
    assert engine.kv_stats()["num_preemptions"] > 0
    assert [outputs[str(i)].output_token_ids[0] for i in range(2)] == [
        dense_greedy("tiny-opt", [p], n)[0] for p, n in zip(prompts, max_tokens)]
