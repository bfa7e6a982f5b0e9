"""FasterTransformer's request-level batching: a batch forms only when the last one has finished,
as large as max-length reservations allow, and requests arriving meanwhile wait."""

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.core.sequence import SamplingParams
from jpaged.paper.baselines.contiguous import ContiguousBlockManager
from jpaged.paper.baselines.request_level import RequestLevelBatching
from jpaged.paper.systems import build_engine


def engine(num_blocks=41, max_num_batched_tokens=2048):
    # max_model_len 256 = 16 blocks of 16; 40 blocks (top blocks 32 + 8) hold B = 2 reservations.
    config = EngineConfig(model=ModelConfig(name="opt-13b"),
                          cache=CacheConfig(block_size=16, num_blocks=num_blocks, num_host_blocks=0),
                          scheduler=SchedulerConfig(max_num_seqs=64, max_model_len=256,
                                                    max_num_batched_tokens=max_num_batched_tokens, policy="paper"),
                          executor="sim")
    return build_engine("fastertransformer", config)


def serve(eng, requests):
    """requests: (arrival, prompt_len, output_len); returns outputs by request id."""
    outputs = {}
    pending = sorted(enumerate(requests), key=lambda r: r[1][0])
    while pending or eng.has_unfinished():
        while pending and pending[0][1][0] <= eng.executor.now():
            i, (arrival, p, o) = pending.pop(0)
            eng.add_request(str(i), [5] * p, SamplingParams(max_tokens=o, ignore_eos=True), arrival_time=arrival)
        if not eng.has_unfinished():
            eng.executor.advance_to(pending[0][1][0])
            continue
        for out in eng.step():
            outputs[int(out.request_id)] = out
    return outputs


def test_default_memory_manager_reserves_max_length():
    eng = engine()
    assert isinstance(eng.scheduler.batching, RequestLevelBatching)
    bm = eng.scheduler.block_manager
    assert isinstance(bm, ContiguousBlockManager) and bm.policy == "max"


def test_batch_runs_to_completion_before_the_next_forms():
    eng = engine()
    # Three at t=0: memory takes two (B = 2); the third waits for both, even the long one.
    outs = serve(eng, [(0.0, 10, 5), (0.0, 10, 40), (0.0, 10, 5)])
    first_batch_end = max(outs[0].finish_time, outs[1].finish_time)
    assert outs[0].first_scheduled_time == outs[1].first_scheduled_time == 0.0
    assert outs[2].first_scheduled_time >= first_batch_end
    assert all(len(o.output_token_ids[0]) == n for o, n in zip((outs[0], outs[1], outs[2]), (5, 40, 5)))


def test_arrival_during_a_batch_waits_even_with_room():
    eng = engine(num_blocks=65)  # room for 4 reservations
    outs = serve(eng, [(0.0, 10, 50), (0.05, 10, 5)])
    assert outs[1].first_scheduled_time >= outs[0].finish_time


def test_token_budget_splits_admission_but_not_the_batch():
    eng = engine(num_blocks=65, max_num_batched_tokens=100)
    # Two 60-token prompts cannot share one prefill step; both still join the first batch.
    outs = serve(eng, [(0.0, 60, 30), (0.0, 60, 30), (0.0, 60, 30)])
    assert outs[1].first_scheduled_time < outs[0].finish_time
    assert outs[2].first_scheduled_time < outs[0].finish_time  # 4 reservations fit: 3 in one batch
