"""No request can stall or poison the engine: the three stalls found under stress, as repros, and
the batching-independence guarantee (seeded outputs do not depend on how requests were batched)."""

import functools

import pytest

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.executors.jax import JaxExecutor


# Two pool sizes (a small one that preempts, a roomy one that never does) for most engines here:
# each pool shape is its own set of compiled programs.
SMALL, ROOMY = 14, 128


def engine(model="tiny-llama", *, block_size=16, num_blocks=SMALL, num_host_blocks=0, mode="recompute",
           policy="chunked", max_num_seqs=16, max_num_batched_tokens=512, watermark=0.0, prefix_caching=False):
    config = EngineConfig(
        model=ModelConfig(name=model, attention_backend="xla"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, num_host_blocks=num_host_blocks,
                          watermark=watermark, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=256, preemption_mode=mode, policy=policy))
    return LLMEngine(config, executor=JaxExecutor(config))


def serve(eng, requests, max_steps=2000):
    """Adds (request_id, prompt, params) in order and steps until done; returns outputs by id."""
    for request_id, prompt, params in requests:
        eng.add_request(request_id, prompt, params)
    outputs = {}
    for _ in range(max_steps):  # bounded: a stalled engine fails here instead of spinning forever
        outputs.update({o.request_id: o for o in eng.step() if o.finished})
        if not eng.has_unfinished():
            break
    assert not eng.has_unfinished(), f"engine stalled with {len(outputs)} of {len(requests)} requests done"
    stats = eng.kv_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_host_blocks"]
    return outputs


REPRO_1 = [("a", list(range(1, 40)), SamplingParams(max_tokens=40, temperature=0.8, seed=1)),
           ("b", list(range(1, 64)), SamplingParams(n=3, max_tokens=20, temperature=0.8, seed=2))]


@pytest.mark.parametrize("policy", ["paper", "chunked"])
def test_recomputed_forked_group_keeps_sharing_its_prompt(policy):
    """Recompute of an n = 3 group re-prefills its sequences sharing the common prompt blocks:
    the group that fit is never refused for size after it ran (it needed 18 blocks when each
    sequence was re-prefilled alone, more than the 13 the pool has)."""
    small = engine(policy=policy)
    got = serve(small, REPRO_1)
    assert small.kv_stats()["num_preemptions"] > 0
    assert got["b"].error is None and [len(t) for t in got["b"].output_token_ids] == [20, 20, 20]
    roomy = serve(engine(num_blocks=ROOMY, policy=policy), REPRO_1)
    assert {k: o.output_token_ids for k, o in got.items()} == {k: o.output_token_ids for k, o in roomy.items()}


@pytest.mark.parametrize("policy, budget", [("chunked", 24), pytest.param("chunked", 512, marks=pytest.mark.slow),
                                            ("paper", 512)])
def test_recomputed_beam_group_stays_aligned_and_exact(policy, budget):
    """A preempted beam group's beams recompute their histories sharing common blocks and rejoin in
    one step; the search ends as it would have without preemption."""
    requests = [("a", list(range(1, 40)), SamplingParams(max_tokens=40, temperature=0.8, seed=1)),
                ("b", list(range(1, 64)), SamplingParams(n=3, use_beam_search=True, max_tokens=20))]
    small = engine(policy=policy, max_num_batched_tokens=budget)
    got = serve(small, requests)
    assert small.kv_stats()["num_preemptions"] > 0
    roomy = serve(engine(num_blocks=ROOMY, policy=policy, max_num_batched_tokens=budget), requests)
    assert got["b"].output_token_ids == roomy["b"].output_token_ids
    assert got["a"].output_token_ids == roomy["a"].output_token_ids


def test_wider_than_max_num_seqs_is_refused_at_the_door_and_recompute_never_livelocks():
    """n above max_num_seqs could never run as one batch after a preemption: refused at add_request.
    At n == max_num_seqs the fresh group reserves its width, so recompute readmits it."""
    eng = engine(num_blocks=20, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"sampling_params.n=3 exceeds scheduler.max_num_seqs=2"):
        eng.add_request("b", list(range(1, 64)), SamplingParams(n=3, max_tokens=20))
    eng = engine(num_blocks=20, max_num_seqs=4)
    got = serve(eng, [("a", list(range(1, 151)), SamplingParams(max_tokens=40)),
                      ("b", list(range(1, 64)), SamplingParams(n=3, max_tokens=20, temperature=1.0))])
    assert eng.kv_stats()["num_preemptions"] > 0
    assert all(o.error is None for o in got.values())
    assert [len(t) for t in got["b"].output_token_ids] == [20, 20, 20]


# Every kind of group in both modes; two of the six pairs run only with -m slow (the suite's time).
@pytest.mark.parametrize("params, mode", [
    pytest.param(SamplingParams(max_tokens=240), "swap", id="swap-long-output", marks=pytest.mark.slow),
    pytest.param(SamplingParams(max_tokens=240), "recompute", id="recompute-long-output"),
    pytest.param(SamplingParams(n=8, max_tokens=120, temperature=1.0), "swap", id="swap-n8"),
    pytest.param(SamplingParams(n=8, max_tokens=120, temperature=1.0), "recompute", id="recompute-n8"),
    pytest.param(SamplingParams(n=4, use_beam_search=True, max_tokens=120), "swap", id="swap-beam4"),
    pytest.param(SamplingParams(n=4, use_beam_search=True, max_tokens=120), "recompute", id="recompute-beam4",
                 marks=pytest.mark.slow)])
def test_a_group_outgrowing_the_pool_ends_with_an_error_and_the_rest_is_served(params, mode):
    """A group whose sequences outgrow the whole pool is aborted with an error (in swap mode it used
    to be swapped out and never come back, freezing the engine); the others finish exactly."""
    requests = [("big", list(range(1, 12)), params), OTHER]
    got = serve(engine(num_host_blocks=32 if mode == "swap" else 0, mode=mode), requests)
    assert "outgrew the whole KV pool" in got["big"].error
    assert got["big"].finished and got["ok"].error is None
    assert got["ok"].output_token_ids == _served_alone()


OTHER = ("ok", list(range(5, 25)), SamplingParams(max_tokens=10))


@functools.cache
def _served_alone() -> list[list[int]]:
    """OTHER's tokens served alone (computed once for every case)."""
    return serve(engine(), [OTHER])["ok"].output_token_ids


SEEDED = [("g", list(range(3, 20)), SamplingParams(max_tokens=14)),
          ("t", list(range(40, 71)), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)),
          ("n", list(range(9, 44)), SamplingParams(n=3, max_tokens=10, temperature=1.2, top_k=20, seed=3)),
          ("beam", list(range(100, 125)), SamplingParams(n=2, use_beam_search=True, max_tokens=9)),
          ("long", list(range(60, 150)), SamplingParams(max_tokens=16, temperature=0.7, seed=11))]


@pytest.mark.parametrize("setting", [
    dict(mode="recompute"),
    dict(num_host_blocks=40, mode="swap"),
    dict(block_size=8, num_blocks=24, mode="recompute"),
    pytest.param(dict(policy="paper", num_host_blocks=40, mode="swap"), marks=pytest.mark.slow),
    dict(max_num_batched_tokens=16, num_blocks=ROOMY),
    pytest.param(dict(max_num_seqs=3, max_num_batched_tokens=40, num_blocks=ROOMY), marks=pytest.mark.slow),
    dict(prefix_caching=True, reverse=True),
], ids=["recompute", "swap", "block8", "paper-swap", "chunk16", "seqs3", "prefix-reversed"])  # (slow: -m slow)
def test_seeded_outputs_do_not_depend_on_batching(setting):
    """Outputs are a function of (seed, request id, sample index, position): pool size, preemption
    mode, block size, policy, chunk size, max_num_seqs and arrival order change nothing."""
    setting = dict(setting)
    order = SEEDED[::-1] if setting.pop("reverse", False) else SEEDED
    eng = engine(**setting)
    got = serve(eng, order)
    assert {k: o.output_token_ids for k, o in got.items()} == _seeded_reference()
    if eng.config.cache.num_blocks == SMALL:  # the small pool's settings are tested under preemption
        assert eng.kv_stats()["num_preemptions"] > 0


@functools.cache
def _seeded_reference() -> dict[str, list[list[int]]]:
    """SEEDED's tokens on a roomy pool, FCFS (computed once for every setting)."""
    return {k: o.output_token_ids for k, o in serve(engine(num_blocks=ROOMY), SEEDED).items()}
