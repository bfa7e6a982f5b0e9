"""The prefix cache's host tier and pinned prefixes on /metrics: PrometheusObserver's jpaged:*
series follow the engine's own counts (kv_stats), counted from when the observer attached."""

from jpaged.entrypoints.serve.metrics import PrometheusObserver
from tests.engine.test_engine_host_tier import _chat, _conversations
from tests.helpers.tiny_engines import make_engine


def _value(observer, name):
    return observer.registry.get_sample_value(name, {"model_name": "m", "engine": "0"})


def test_host_tier_series_follow_the_engines_counts():
    engine = make_engine(num_blocks=14, num_host_blocks=0, prefix_caching=True, num_host_cache_blocks=40)
    _chat(engine, _conversations(rounds=1))  # before the observer: not counted
    seen = engine.kv_stats()
    observer = PrometheusObserver("m")
    observer.attach(engine)
    _chat(engine, _conversations(rounds=3, seed=1))
    stats = engine.kv_stats()
    assert stats["host_cache_promotions"] > seen["host_cache_promotions"]  # the run exercised the tier
    for key in ("promotions", "offloads", "evictions"):
        assert _value(observer, f"jpaged:host_cache_{key}_total") == stats[f"host_cache_{key}"] - seen[f"host_cache_{key}"]
    assert _value(observer, "jpaged:prefix_cache_evictions_total") == (stats["prefix_cache_evictions"]
                                                                        - seen["prefix_cache_evictions"])
    assert _value(observer, "jpaged:host_cache_usage_perc") == stats["host_cache_usage"] > 0
    assert _value(observer, "jpaged:pinned_prefix_blocks") == 0
