"""The simulated fleet: sglang-router's cache-aware rule by hand, all-reduce across hosts by hand, and
the event loop (one replica reproduces run_trace exactly; multi-turn sessions follow their replies;
the measurement window; refused requests end their session while the others are served)."""

import dataclasses

import numpy as np
import pytest

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.paper.sim.cost_model import CostModel, CostModelConfig
from jpaged.paper.sim.executor import SIMULATED_TOKEN
from jpaged.paper.sim.fleet import run_fleet
from jpaged.paper.sim.gpus import get_gpu
from jpaged.paper.sim.interconnect import InterHostLink, cross_host_cost
from jpaged.paper.sim.routing import CacheAware, RoundRobin, RouterConfig, make_router
from jpaged.paper.systems import SimConfig, build_engine
from jpaged.paper.trace_runner import run_trace
from jpaged.paper.workloads import Session, TraceRequest, prefix_pool_sessions

BLOCK = 4


def prompt(*blocks: int, extra: int = 0) -> list[int]:
    """Token ids: one 4-token block per value in `blocks` (all tokens = that value), then `extra` ones."""
    return [b for b in blocks for _ in range(BLOCK)] + [99] * extra


def test_round_robin_takes_replicas_in_turn():
    router = RoundRobin(3)
    assert [router.route(prompt(1), [0, 0, 0]) for _ in range(5)] == [0, 1, 2, 0, 1]
    assert router.decisions == {"round_robin": 5}


def test_cache_aware_rule_by_hand():
    router = CacheAware(2, RouterConfig(block_size=BLOCK))
    a = prompt(1, 2, 3)
    assert router.route(a, [0, 0]) == 0  # empty tree: the smallest (lowest index among equals)
    assert router.route(prompt(7, 8), [0, 0]) == 1  # no match: replica 1's tree is smaller (0 < 12 tokens)
    assert router.tree.sizes == [12, 8]
    assert router.route(a + [5, 6], [0, 0]) == 0  # 12 of 14 tokens matched > 0.3: the prefix's replica
    # 12 of 40 tokens = 0.3 exactly: not above the threshold, so the smallest tree (replica 1, 8 tokens)
    assert router.route(prompt(1, 2, 3, extra=28), [0, 0]) == 1
    assert router.decisions == {"smallest_tree": 3, "prefix_match": 1}
    # Imbalanced (70 - 0 > 64 and 70 > 1.5 x 0): the least-loaded replica whatever the prefix
    assert router.route(a, [0, 70]) == 0 and router.decisions["load_balance"] == 1
    assert router.route(a, [80, 10]) == 1 and router.decisions["load_balance"] == 2
    # ... which makes replica 1 the most recent user of a's blocks: a now follows it
    assert router.route(a, [0, 0]) == 1
    # Only an absolute gap > 64 with a ratio > 1.5 is imbalanced: 66 apart but 200 < 1.5 x 134
    assert router.route(prompt(7, 8, extra=1), [200, 134]) == 1 and router.decisions["load_balance"] == 2


def test_router_tree_counts_each_replicas_distinct_tokens():
    router = CacheAware(2, RouterConfig(block_size=BLOCK))
    router.route(prompt(1, 2), [0, 0])  # -> 0
    router.route(prompt(1, 2, 3), [0, 0])  # 8 of 12 matched: -> 0, one new block
    router.route(prompt(1, 2, extra=3), [0, 0])  # partial last block: not in the tree
    assert router.tree.sizes == [12, 0]
    assert router.tree.match([tuple(prompt(1)), tuple(prompt(2)), tuple(prompt(9))]) == (8, 0)
    assert router.tree.match([tuple(prompt(9))]) == (0, None)


@pytest.mark.parametrize("field,value", [("cache_threshold", 1.0), ("cache_threshold", -0.1),
                                         ("balance_abs_threshold", -1), ("balance_rel_threshold", 0.5),
                                         ("block_size", 0)])
def test_router_config_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"router.{field}"):
        RouterConfig(**{field: value})


def test_make_router_checks_its_arguments():
    assert isinstance(make_router("cache_aware", 2), CacheAware)
    with pytest.raises(ValueError, match="policy must be one of round_robin, cache_aware"):
        make_router("random", 2)
    with pytest.raises(ValueError, match="num_replicas"):
        make_router("round_robin", 0)


def test_one_host_keeps_the_nvlink_constants():
    cost = CostModelConfig()
    assert cross_host_cost(cost, get_gpu("a100-40gb"), 8, 1) is cost


def test_cross_host_all_reduce_by_hand():
    """OPT-175B on 2 x 8 A100-40GB: the ring's bus bandwidth is the smaller of NVLink's measured
    192 GB/s and 8 adapters x 25 GB/s x 0.9 = 180 GB/s; every all-reduce pays 20 us more."""
    base = CostModelConfig(nvlink_efficiency=0.64, allreduce_floor_s=60e-6, allreduce_fixed_s=30e-6)
    cost = cross_host_cost(base, get_gpu("a100-40gb"), 16, 2, InterHostLink())
    assert cost.nvlink_efficiency == pytest.approx(180e9 / 300e9)
    assert (cost.allreduce_floor_s, cost.allreduce_fixed_s) == pytest.approx((80e-6, 50e-6))
    model = CostModel(get_preset("opt-175b"), get_gpu("a100-40gb"), cost, tp=16)
    comm = lambda n: model.breakdown(np.ones(n, np.int32), np.ones(n, np.int32))["communication"]  # noqa: E731
    # 64 tokens: 64 x 12288 x 2 B, a ring sends 2 x 15/16 of it: 2.95 MB / 180 GB/s = 16.4 us + 50 us
    # fixed < the 80 us floor. 2 all-reduces x 96 layers.
    assert comm(64) == pytest.approx(192 * 80e-6)
    # 2048 tokens: 94.4 MB / 180 GB/s = 524 us + 50 us
    assert comm(2048) == pytest.approx(192 * (50e-6 + 2048 * 12288 * 2 * 1.875 / 180e9))
    # One GPU per host: one adapter carries the ring, 22.5 GB/s.
    one_each = cross_host_cost(base, get_gpu("a100-40gb"), 2, 2)
    assert one_each.nvlink_efficiency * 300e9 == pytest.approx(22.5e9)


@pytest.mark.parametrize("field,value", [("adapter_bw", 0.0), ("adapters_per_host", 0), ("efficiency", 1.5),
                                         ("latency_s", -1e-6)])
def test_link_names_the_bad_field(field, value):
    with pytest.raises(ValueError, match=f"link.{field}"):
        InterHostLink(**{field: value})


def test_hosts_must_divide_the_group():
    with pytest.raises(ValueError, match="hosts must be >= 1 and divide tp"):
        cross_host_cost(CostModelConfig(), get_gpu("a100-40gb"), 8, 3)


def engine_config(num_blocks: int = 64, max_model_len: int = 512) -> EngineConfig:
    return EngineConfig(model=ModelConfig(name="opt-125m"),
                        cache=CacheConfig(block_size=16, num_blocks=num_blocks, num_host_blocks=0,
                                          enable_prefix_caching=True),
                        scheduler=SchedulerConfig(policy="paper", max_num_seqs=32, max_num_batched_tokens=512,
                                                  max_model_len=max_model_len),
                        executor="sim")


def replicas(count: int, **kwargs) -> list:
    return [build_engine("vllm", engine_config(**kwargs), SimConfig()) for _ in range(count)]


def pool_sessions(rate: float, seconds: float, num_prefixes: int = 3) -> list[Session]:
    return prefix_pool_sessions(rate, seconds, 0, num_prefixes=num_prefixes, prefix_len=64, zipf_s=0.0,
                                input_median=12, input_sigma=0.5, output_median=8, output_sigma=0.5, vocab_size=1000)


def test_one_replica_reproduces_run_trace():
    sessions = pool_sessions(200.0, 2.0)
    fleet = run_fleet(replicas(1), make_router("round_robin", 1), sessions)
    engine = replicas(1)[0]
    trace = run_trace(engine, [TraceRequest(s.session_id, s.start_time, len(s.queries[0]), s.output_lens[0],
                                            s.queries[0]) for s in sessions])
    timings = lambda records: sorted((r.arrival_time, r.first_scheduled_time, r.first_token_time, r.finish_time)  # noqa: E731
                                     for r in records)
    assert len(fleet.records) == len(sessions) > 100
    assert timings(fleet.records) == timings(trace.records)
    assert fleet.prefix_hit_rate == engine.prefix_cache_stats()["prefix_cache_hit_rate"] > 0.5


def test_cache_aware_keeps_prefixes_where_they_are_cached():
    """Four 64-token prefixes, two replicas whose pools hold two prefixes each beside the running
    requests: the cache-aware router keeps each prefix on one replica, round-robin sends all four to both."""
    sessions = pool_sessions(60.0, 4.0, num_prefixes=4)
    results = {}
    for policy in ("round_robin", "cache_aware"):
        engines = replicas(2, num_blocks=12)
        results[policy] = run_fleet(engines, make_router(policy, 2), sessions)
        assert all(not e.has_unfinished() for e in engines)
        assert sum(r["requests"] for r in results[policy].replicas) == len(sessions)
    aware = results["cache_aware"]
    assert aware.decisions["prefix_match"] > 0.9 * len(sessions)
    assert aware.prefix_hit_rate > results["round_robin"].prefix_hit_rate + 0.05


class RecordingRouter(RoundRobin):
    """Round-robin that keeps every prompt it routes and the loads it saw, in order."""

    def __init__(self, num_replicas: int):
        super().__init__(num_replicas)
        self.prompts: list[list[int]] = []
        self.loads: list[list[int]] = []

    def route(self, prompt, loads):
        self.prompts.append(list(prompt))
        self.loads.append(list(loads))
        return super().route(prompt, loads)


def one_turn(session_id: int, start: float) -> Session:
    return Session(session_id, start, (np.arange(4, 44, dtype=np.int32) + session_id,), (1,), ())


def test_the_router_learns_of_a_finish_when_its_step_ends():
    """A's one-token request finishes in the step it is admitted by, [0, t1]: a request arriving
    inside that step still counts A in the load; one arriving exactly at t1 does not."""
    (record,) = run_fleet(replicas(1), RoundRobin(1), [one_turn(0, 0.0)]).records
    t1 = record.finish_time
    for arrival, seen in ((t1 / 2, [1]), (t1, [0])):
        router = RecordingRouter(1)
        run_fleet(replicas(1), router, [one_turn(0, 0.0), one_turn(1, arrival)])
        assert router.loads == [[0], seen]


def conversation(turns: int = 3, start: float = 0.5) -> Session:
    rng = np.random.default_rng(0)
    return Session(0, start, tuple(rng.integers(4, 1000, n, dtype=np.int32) for n in (40, 12, 20)[:turns]),
                   (10, 6, 4)[:turns], (1.5, 0.25)[: turns - 1])


def test_a_turn_follows_its_reply_after_the_think_time():
    router = RecordingRouter(1)
    session = conversation()
    result = run_fleet(replicas(1), router, [session])
    records = sorted(result.records, key=lambda r: r.request_id)
    assert [r.prompt_len for r in records] == [40, 40 + 10 + 12, 62 + 6 + 20]
    for before, after, think in zip(records, records[1:], session.think_s):
        assert after.arrival_time == pytest.approx(before.finish_time + think)
    first, second = router.prompts[:2]
    assert second == first + [SIMULATED_TOKEN] * 10 + session.queries[1].tolist()  # the reply as produced
    assert result.prefix_hit_rate > 0  # the history's full blocks came from the prefix cache


def test_measurement_window_keeps_only_its_arrivals_and_stops_after_them():
    sessions = pool_sessions(100.0, 6.0)
    result = run_fleet(replicas(2), make_router("cache_aware", 2), sessions, measure_from=2.0, measure_until=4.0)
    arrivals = [r.arrival_time for r in result.records]
    assert len(arrivals) == sum(2.0 <= s.start_time < 4.0 for s in sessions) and 2.0 <= min(arrivals) < max(arrivals) < 4.0
    assert result.end_time_s < 5.0  # arrivals after the window are not waited for
    assert 0 < result.prefix_hit_rate < 1


@pytest.mark.parametrize("query,reply,reason", [(600, 4, "the door refuses a prompt over max_model_len"),
                                                (200, 100, "the scheduler ends a request outgrowing the 16-block pool")])
def test_a_refused_request_ends_its_session_and_the_rest_is_served(query, reply, reason):
    rng = np.random.default_rng(1)
    doomed = Session(0, 0.0, tuple(rng.integers(4, 1000, n, dtype=np.int32) for n in (20, query, 5)), (4, reply, 4),
                     (0.1, 0.1))
    others = pool_sessions(20.0, 1.0)
    others = [dataclasses.replace(s, session_id=s.session_id + 1) for s in others]
    result = run_fleet(replicas(1, num_blocks=17), make_router("round_robin", 1), [doomed, *others])
    assert result.num_rejected == 1, reason
    assert len(result.records) == 1 + len(others)  # the doomed session's first turn, and everyone else


def test_run_fleet_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="at least one replica"):
        run_fleet([], RoundRobin(1), [])
    with pytest.raises(ValueError, match="measure_from < measure_until"):
        run_fleet(replicas(1), RoundRobin(1), [], measure_from=3.0, measure_until=1.0)
    used = replicas(1)[0]
    used.executor.advance_to(1.0)
    with pytest.raises(ValueError, match=r"engines\[0\]: must be fresh"):
        run_fleet([used], RoundRobin(1), [])
