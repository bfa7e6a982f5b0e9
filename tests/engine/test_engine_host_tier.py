"""The prefix cache's host tier and pinned prefixes through the engine, on the real tiny model: the
same tokens with the tier on and off (greedy and seeded, both eviction policies, both preemption
modes), more prompt tokens from the cache, every block back in both pools."""

import numpy as np
import pytest

from jpaged.core.sequence import SamplingParams
from tests.helpers.tiny_engines import make_engine

SYSTEM = list(range(200, 228))  # 28 tokens: 3 full blocks of 8 and a partial one of 4


def _conversations(rounds=3, num=3, seed=0):
    """Rounds of `num` conversations: each round's prompt is the conversation so far (system prompt,
    earlier queries and replies) and a new query; replies are filled in as rounds are served."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(1, 200, size=int(rng.integers(3, 12))).tolist() for _ in range(rounds)]
            for _ in range(num)]


def _params(conv, rnd):
    """Greedy for even conversations, seeded sampling for odd ones."""
    if conv % 2 == 0:
        return SamplingParams(max_tokens=6, ignore_eos=True)
    return SamplingParams(max_tokens=6, temperature=0.9, seed=conv * 10 + rnd, ignore_eos=True)


def _chat(engine, queries):
    """Serves the conversations round by round, one request at a time (so each round finds the
    others' rounds evicting its history); returns every reply and its cumulative log-probability
    (which wrong KV in a promoted block would move, even where the tiny model's tokens do not)."""
    history = [list(SYSTEM) for _ in queries]
    replies, logprobs = [], []
    for rnd in range(len(queries[0])):
        for c, conv in enumerate(queries):
            history[c] += conv[rnd]
            out = engine.generate([history[c]], _params(c, rnd), use_tqdm=False)[0]
            reply = list(out.outputs[0].token_ids)
            history[c] += reply
            replies.append(reply)
            logprobs.append(out.outputs[0].cumulative_logprob)
    return replies, np.array(logprobs)


def _all_free(engine):
    stats = engine.kv_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] - stats["num_pinned_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_host_blocks"]


@pytest.mark.parametrize("eviction_policy", ["lru", "arc"])
def test_host_tier_serves_evicted_history_with_the_same_tokens(eviction_policy):
    queries = _conversations()
    small = dict(num_blocks=14, num_host_blocks=0, prefix_caching=True)  # 13 blocks: one conversation's history
    reference, reference_logprobs = _chat(make_engine(**small), queries)
    tiered = make_engine(**small, num_host_cache_blocks=40, eviction_policy=eviction_policy)
    replies, logprobs = _chat(tiered, queries)
    assert replies == reference
    np.testing.assert_allclose(logprobs, reference_logprobs, rtol=1e-4, atol=1e-4)  # (other batch shapes: rounding)
    plain = make_engine(**small)
    _chat(plain, queries)
    stats, before = tiered.kv_stats(), plain.kv_stats()
    assert stats["host_cache_promotions"] > 0 and stats["host_cache_offloads"] >= stats["host_cache_promotions"]
    assert stats["prefix_cached_tokens"] == before["prefix_cached_tokens"] + stats["host_cache_hit_tokens"]
    assert tiered.num_prefill_tokens == plain.num_prefill_tokens - stats["host_cache_hit_tokens"]
    assert 0 < stats["host_cache_used_blocks"] <= stats["host_cache_blocks"] == 40
    _all_free(tiered)


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_host_tier_under_preemption(mode):
    rng = np.random.default_rng(3)
    prompts = [SYSTEM + rng.integers(1, 200, size=n).tolist() for n in (5, 13, 2, 20, 9, 30)]
    params = [_params(i, 0) for i in range(len(prompts))]
    params = [SamplingParams(max_tokens=14, ignore_eos=True, temperature=p.temperature, seed=p.seed) for p in params]
    expected = [o.outputs[0].token_ids for o in make_engine().generate(prompts, params, use_tqdm=False)]
    engine = make_engine(num_blocks=16, num_host_blocks=12, preemption_mode=mode, prefix_caching=True,
                         num_host_cache_blocks=8)
    for _ in range(2):  # the second pass finds the first's blocks, some of them in the tier
        got = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
        assert got == expected
    stats = engine.kv_stats()
    assert stats["num_preemptions"] > 0 and stats["host_cache_offloads"] > 0
    _all_free(engine)


def test_pinned_prefix_is_computed_once_and_shared():
    rng = np.random.default_rng(5)
    prompts = [SYSTEM + rng.integers(1, 200, size=n).tolist() for n in (1, 6, 11)]
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in make_engine().generate(prompts, params, use_tqdm=False)]
    engine = make_engine(prefix_caching=True)
    assert engine.pin_prefix(SYSTEM) == 4 and engine.pin_prefix(SYSTEM) == 4  # 3 full blocks + the partial one
    computed = engine.num_prefill_tokens
    got = [o.outputs[0].token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    # No request computes any of the 28 prefix tokens, the 4 of the partial block included.
    assert engine.num_prefill_tokens - computed == sum(len(p) - len(SYSTEM) for p in prompts)
    assert engine.kv_stats()["num_pinned_blocks"] == 4 and not engine.has_unfinished()
    _all_free(engine)


def test_pin_prefix_refuses_what_it_cannot_do():
    with pytest.raises(ValueError, match="cache.enable_prefix_caching"):
        make_engine().pin_prefix(SYSTEM)
    engine = make_engine(prefix_caching=True)
    with pytest.raises(ValueError, match="prefix"):
        engine.pin_prefix([10**6])
    engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="idle"):
        engine.pin_prefix(SYSTEM)
