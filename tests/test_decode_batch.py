"""The persistent decode batch (jpaged.decode_batch) is an optimisation only: whenever a step skips
the per-row stop checks, no row could have stopped, the table width is the one its contexts need,
and every request ends exactly as it does with the per-row checks on every step."""

import zlib

import numpy as np
import pytest

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.decode_batch import DecodeBatch
from jpaged.engine import EngineObserver, LLMEngine
from jpaged.executors.base import ModelOutput
from jpaged.sequence import SamplingParams
from jpaged.step_plan import bucket

VOCAB = 40


class HashTokens:
    """No model: each sampled token is a hash of (request, position), so stop tokens are hit."""

    vocab_size = VOCAB

    def __init__(self):
        self.clock = 0.0

    def execute(self, plan) -> ModelOutput:
        self.clock += 1e-3
        rows = plan.sampling
        if rows is None:
            return ModelOutput([], None, None, None, 1e-3)
        tokens = [zlib.crc32(f"{s.group.request_id}/{len(s)}".encode()) % VOCAB for s in rows.seqs]
        return ModelOutput(tokens, np.full(len(tokens), -0.5, np.float32), None, None, 1e-3)

    def now(self) -> float:
        return self.clock


class CheckSkippedStops(EngineObserver):
    """Asserts, at every step, what a step that skips the per-row stop checks promises."""

    def __init__(self):
        self.num_skipping_steps = 0

    def on_step_executed(self, engine, out, result, start, end):
        plan = out.plan
        bm = engine.scheduler.block_manager
        if plan.num_seqs:
            longest = int(plan.context_lens[: plan.num_seqs].max())
            assert plan.block_tables.shape[1] == min(bucket(-(-longest // bm.block_size)), bm.max_blocks_per_seq)
        rows = plan.sampling
        if rows is None or rows.stop_tokens is None:
            return
        self.num_skipping_steps += 1
        for seq in rows.seqs:
            assert len(seq.token_ids) + 1 < seq.group.max_total_len  # this step's token cannot end it by length
            assert seq.group.stop_set <= rows.stop_tokens


def serve(policy, mode, block_size, num_blocks, observer=None):
    """Serves a fixed mix of requests (stop tokens, EOS, lengths) to the end; outputs by request id."""
    config = EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, num_host_blocks=num_blocks,
                                            watermark=0.0, enable_prefix_caching=True),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96,
                                                    policy=policy, preemption_mode=mode), executor="sim")
    engine = LLMEngine(config, executor=HashTokens(), eos_token_ids=[3])
    if observer is not None:
        engine.observers.append(observer)
    rng = np.random.default_rng(0)
    for i in range(24):
        prompt = rng.integers(4, VOCAB, int(rng.integers(2, 30))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(1, 50)), ignore_eos=bool(i % 3 == 0),
                                stop_token_ids=(5,) if i % 4 == 1 else ())
        engine.add_request(f"r{i}", prompt, params, arrival_time=0.0)
    outputs = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.has_unfinished()
    assert engine.scheduler.block_manager.num_free_blocks == num_blocks - 1
    return {k: (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].cumulative_logprob)
            for k, o in outputs.items()}


@pytest.mark.parametrize("policy", ["paper", "chunked"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("block_size,num_blocks", [(4, 40), (16, 12)])
def test_skipped_stop_checks_change_nothing(policy, mode, block_size, num_blocks, monkeypatch):
    observer = CheckSkippedStops()
    fast = serve(policy, mode, block_size, num_blocks, observer)
    assert observer.num_skipping_steps > 0
    monkeypatch.setattr(DecodeBatch, "stops_only_by_token", property(lambda self: False))
    assert serve(policy, mode, block_size, num_blocks) == fast
