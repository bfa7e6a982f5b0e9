"""run_trace: arrivals on the virtual clock, idle jumps, determinism, early stop, metrics."""

import numpy as np
import pytest

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.paper.systems import build_engine
from jpaged.paper.trace_runner import run_trace
from jpaged.paper.workloads import TraceRequest, WorkloadConfig, generate_trace

CONFIG = EngineConfig(model=ModelConfig(name="opt-13b"), cache=CacheConfig(num_blocks=984, num_host_blocks=0),
                      scheduler=SchedulerConfig(), executor="sim")


def request(i, arrival, prompt_len, output_len):
    return TraceRequest(i, arrival, prompt_len, output_len, np.full(prompt_len, 7, np.int32))


def test_idle_engine_jumps_to_the_next_arrival():
    trace = [request(0, 0.0, 50, 10), request(1, 100.0, 50, 10)]
    result = run_trace(build_engine("vllm", CONFIG), trace)
    a, b = sorted(result.records, key=lambda r: r.request_id)
    assert a.first_scheduled_time == 0.0 and b.first_scheduled_time == 100.0  # served on arrival
    assert b.finish_time - b.arrival_time == pytest.approx(a.finish_time - a.arrival_time)
    assert result.end_time_s == b.finish_time and result.avg_batched_requests == pytest.approx(1.0)
    assert result.num_steps == 20 and result.num_rejected == 0


def test_deterministic_for_a_seed():
    trace = generate_trace(WorkloadConfig(request_rate=3.0, duration_s=20, seed=3))
    first, second = (run_trace(build_engine("orca_pow2", CONFIG), trace) for _ in range(2))
    assert first.records == second.records and first.num_steps == second.num_steps


def test_until_stops_early_and_kv_usage_sums_to_100():
    trace = generate_trace(WorkloadConfig(request_rate=3.0, duration_s=60, seed=0))
    result = run_trace(build_engine("vllm", CONFIG), trace, track_kv=True, until=10.0)
    assert 10.0 <= result.end_time_s < 11.0 and len(result.records) < len(trace)
    usage = result.kv_usage
    assert sum(usage.values()) == pytest.approx(100.0) and usage["external_frag_pct"] == 0.0
    # Paged waste: only unfilled slots of the sequences' last blocks (the paper: < 4%).
    assert usage["reserved_pct"] + usage["internal_frag_pct"] < 4.0


def test_requests_that_never_fit_are_counted_not_recorded():
    small = EngineConfig(model=ModelConfig(name="opt-13b"), cache=CacheConfig(num_blocks=33, num_host_blocks=0),
                         scheduler=SchedulerConfig(), executor="sim")  # 32 blocks: Orca Max needs 128
    result = run_trace(build_engine("orca_max", small), [request(0, 0.0, 20, 5), request(1, 1.0, 20, 5)])
    assert result.num_rejected == 2 and result.records == []
