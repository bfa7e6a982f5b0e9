"""Pinned prefixes through the engine, on the simulated executor (the scheduler and block manager
run for real, no model): pinning what the cache holds, pins that share blocks counted once, the fit
rule of requests that share pinned blocks, errors that name the prefix, the pinned-blocks gauge,
and `num_host_blocks=0` with a host tier (no swap). Block size 4, 14 blocks (13 usable)."""

import pytest

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.entrypoints.engine_args import load_engine
from jpaged.entrypoints.serve.metrics import PrometheusObserver
from jpaged.paper.sim.executor import SimExecutor
from tests.helpers.tiny_engines import run_to_end

BS = 4
P = list(range(1, 9))  # 8 tokens: two full blocks
P16 = list(range(1, 17))  # 16 tokens: four full blocks


def sim_engine(num_blocks=14, max_model_len=64, num_host_blocks=0, num_host_cache_blocks=0,
               preemption_mode="recompute", max_num_seqs=8):
    """A simulated engine with the prefix cache on (block size 4)."""
    config = EngineConfig(
        cache=CacheConfig(block_size=BS, num_blocks=num_blocks, num_host_blocks=num_host_blocks, watermark=0.0,
                          enable_prefix_caching=True, num_host_cache_blocks=num_host_cache_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256, max_model_len=max_model_len,
                                  preemption_mode=preemption_mode),
        executor="sim")
    return LLMEngine(config, executor=SimExecutor(get_preset("tiny-opt")))


def generate(engine, prompt, max_tokens=2):
    """Runs one request to its end; returns its output."""
    engine.add_request(f"r{engine._num_arrivals}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    (out,) = run_to_end(engine).values()
    return out


def distinct_pinned(engine):
    """The distinct device blocks the pins hold, read off the reference counts of an idle engine."""
    bm = engine.scheduler.block_manager
    return {b for b in range(1, bm.num_blocks) if bm.refcount[b] > 0}


def test_pinning_a_cached_prefix_takes_a_pin_on_the_cached_blocks():
    engine = sim_engine()
    generate(engine, P + [9, 9])
    bm = engine.scheduler.block_manager
    cached = bm.match_prefix(P + [30]).blocks
    assert len(cached) == 2
    assert engine.pin_prefix(P) == 2
    assert not engine.has_unfinished()
    assert distinct_pinned(engine) == set(cached) and engine.kv_stats()["num_pinned_blocks"] == 2
    assert bm.refcount[cached].tolist() == [1, 1]  # the pin's reference only
    assert engine.pin_prefix([40, 41, 42]) == 1  # the engine is free for the next pin
    assert engine.kv_stats()["num_pinned_blocks"] == 3


def test_pinning_the_start_of_a_pinned_prefix_shares_its_blocks():
    engine = sim_engine()
    assert engine.pin_prefix(P16) == 4
    computed = engine.num_prefill_tokens
    assert engine.pin_prefix(P16[:8]) == 2
    assert engine.num_prefill_tokens == computed  # taken from the cache, nothing computed
    assert not engine.has_unfinished() and engine.kv_stats()["num_pinned_blocks"] == 4
    assert len(distinct_pinned(engine)) == 4


def test_an_error_while_pinning_strands_no_request(monkeypatch):
    engine = sim_engine()
    bm = engine.scheduler.block_manager

    def broken(*args, **kwargs):
        raise ValueError("pin_prefix: broken")

    monkeypatch.setattr(bm, "pin_prefix", broken)
    with pytest.raises(ValueError, match="broken"):
        engine.pin_prefix(P + [9])
    assert not engine.has_unfinished() and bm.num_free_blocks == bm.num_usable_blocks
    monkeypatch.undo()
    assert engine.pin_prefix(P + [9]) == 3


def test_a_request_sharing_a_pinned_prefix_needs_only_its_own_blocks():
    engine = sim_engine()
    pinned = list(range(1, 33))
    assert engine.pin_prefix(pinned) == 8  # 5 blocks left
    out = generate(engine, pinned + list(range(40, 48)))  # 41 tokens at the first sample: 3 blocks of its own
    assert out.error is None and out.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="KV blocks"):  # the same length sharing nothing: 11 blocks
        engine.add_request("fresh", list(range(20, 60)), SamplingParams(max_tokens=2))
    assert engine.kv_stats()["num_free_blocks"] == 13 - 8


def test_pins_that_share_blocks_are_counted_once():
    engine = sim_engine()
    assert engine.pin_prefix(P16 + [30]) == 5 and engine.pin_prefix(P16 + [31]) == 5
    stats = engine.kv_stats()
    assert stats["num_pinned_blocks"] == 6 == len(distinct_pinned(engine))
    assert stats["num_free_blocks"] == 13 - 6
    assert engine.pin_prefix(P16 + [32]) == 5 and engine.kv_stats()["num_pinned_blocks"] == 7
    out = generate(engine, P16 + [30, 1, 2])  # 19 tokens sharing 4 pinned blocks
    assert out.error is None and out.outputs[0].finish_reason == "length"
    assert engine.kv_stats()["num_free_blocks"] == 13 - 7


def test_pin_errors_name_the_prefix():
    engine = sim_engine(max_model_len=64)
    with pytest.raises(ValueError) as err:
        engine.pin_prefix(list(range(1, 65)))  # max_model_len
    assert "prefix" in str(err.value) and "pin-" not in str(err.value) and "prompt" not in str(err.value)
    with pytest.raises(ValueError) as err:
        engine.pin_prefix(list(range(1, 61)))  # 61 tokens: 16 blocks, the pool has 13
    assert "prefix" in str(err.value) and "pin-" not in str(err.value) and "prompt" not in str(err.value)
    assert not engine.has_unfinished()


def _load(**kwargs):
    return load_engine("tiny-opt", executor=SimExecutor(get_preset("tiny-opt")), enable_prefix_caching=True,
                       block_size=BS, num_blocks=14, max_model_len=64, **kwargs)


@pytest.mark.parametrize("value, words", [("ab", r"got str 'ab'; .* pass \['ab'\]"), (5, "got int 5$"),
                                          ([1, 2, 3], r"got list .* pass \[\[1, 2, 3\]\]")])
def test_pinned_prefixes_must_be_a_list_of_prefixes(value, words):
    with pytest.raises(TypeError, match=rf"pinned_prefixes: must be a list of prefixes .*{words}"):
        _load(pinned_prefixes=value)


def test_pinned_prefixes_that_cannot_be_pinned_are_named():
    with pytest.raises(ValueError, match=r"pinned_prefixes\[1\]: prefix of 64 tokens"):
        _load(pinned_prefixes=[[1, 2, 3], list(range(1, 65))])
    engine, _ = _load(pinned_prefixes=[P16, P16[:8], [5, 6, 7]])
    assert engine.kv_stats()["num_pinned_blocks"] == 5


def test_the_pinned_blocks_gauge_reads_the_pins_from_the_start():
    engine = sim_engine()
    engine.pin_prefix(P16 + [30])
    observer = PrometheusObserver("m")
    observer.attach(engine)
    assert observer.registry.get_sample_value("jpaged:pinned_prefix_blocks", {"model_name": "m", "engine": "0"}) == 5


def test_no_swap_space_means_no_swap_even_with_a_host_tier():
    engine = sim_engine(num_blocks=14, num_host_blocks=0, num_host_cache_blocks=8, preemption_mode="swap")
    for i in range(4):  # 4 x (7 + 12) tokens want 20 blocks: preemptions
        engine.add_request(f"r{i}", [i * 8 + t for t in range(1, 8)], SamplingParams(max_tokens=12, ignore_eos=True))
    swapped = 0
    while engine.has_unfinished():
        engine.step()
        swapped = max(swapped, len(engine.scheduler.swapped))
    assert engine.kv_stats()["num_preemptions"] > 0 and swapped == 0  # recomputed, never swapped
