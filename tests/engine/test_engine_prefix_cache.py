"""Prefix caching through the engine: same greedy outputs, fewer prefill tokens, salts isolate."""

import numpy as np
import pytest

from jpaged.core.sequence import SamplingParams
from tests.helpers.tiny_engines import make_engine

SYSTEM = list(range(200, 240))  # a 40-token shared system prompt: 5 full blocks of 8


def _prompts():
    rng = np.random.default_rng(1)
    return [SYSTEM + rng.integers(1, 200, size=n).tolist() for n in (3, 9, 17, 5, 12, 1)]


def _serve(engine, prompts, salts=None):
    outputs = []
    for i, p in enumerate(prompts):  # one at a time, so later requests find earlier blocks cached
        engine.add_request(str(i), p, SamplingParams(max_tokens=8), cache_salt=None if salts is None else salts[i])
        while engine.has_unfinished():
            outputs += engine.step()
    return [o.output_token_ids[0] for o in sorted(outputs, key=lambda o: int(o.request_id))]


def test_shared_system_prompt_same_outputs_fewer_prefill_tokens():
    prompts = _prompts()
    plain = make_engine()
    cached = make_engine(prefix_caching=True)
    assert _serve(cached, prompts) == _serve(plain, prompts)
    shared = len(SYSTEM) * (len(prompts) - 1)  # every request after the first reuses 5 blocks
    assert plain.num_prefill_tokens - cached.num_prefill_tokens == shared
    stats = cached.kv_stats()
    assert stats["prefix_cached_tokens"] == shared
    assert stats["prefix_cache_hit_rate"] == pytest.approx(shared / sum(map(len, prompts)))
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_concurrent_requests_share_blocks_while_running():
    engine = make_engine(prefix_caching=True)
    prompts = _prompts()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(max_tokens=4))
    engine.step()  # one prefill admits all; later prompts share the first one's system blocks
    bm = engine.scheduler.block_manager
    first = bm.rows.table(engine._groups["0"].seqs[0].seq_id)[:5]
    for i in range(1, len(prompts)):
        assert list(bm.rows.table(engine._groups[str(i)].seqs[0].seq_id)[:5]) == list(first)
    assert all(bm.refcount[b] == len(prompts) for b in first)


def test_salts_isolate_tenants():
    prompts = _prompts()[:3]
    engine = make_engine(prefix_caching=True)
    _serve(engine, prompts, salts=["a", "b", "c"])
    assert engine.kv_stats()["prefix_cached_tokens"] == 0
    _serve(engine, [prompts[0]], salts=["a"])
    assert engine.kv_stats()["prefix_cached_tokens"] == len(SYSTEM)


# swap is slow: the recompute case runs by default, and the liveness property test covers prefix
# caching under swap preemption (tests/test_scheduler_liveness.py).
@pytest.mark.parametrize("mode", [pytest.param("swap", marks=pytest.mark.slow), "recompute"])
def test_prefix_caching_under_preemption(mode):
    prompts = _prompts()
    params = SamplingParams(max_tokens=12)
    expected = [o.output_token_ids for o in make_engine().generate(prompts, params, use_tqdm=False)]
    engine = make_engine(prefix_caching=True, num_blocks=14, preemption_mode=mode)
    got = [o.output_token_ids for o in engine.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    stats = engine.kv_stats()
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
