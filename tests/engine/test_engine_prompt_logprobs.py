"""Prompt log-probabilities (SamplingParams.prompt_logprobs) equal a dense forward of the same model,
through chunked prefill, recompute and swap preemption and prefix-cache hits, and cost nothing to
a batch where no request asks."""

import collections

import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.core.sequence import SamplingParams
from jpaged.engine import EngineObserver, LLMEngine
from jpaged.executors.jax import JaxExecutor
from tests.helpers.tiny_engines import PAD_LEN, dense_logprobs_fn, run_to_end

MODEL = "tiny-opt"


def _engine(*, block_size=8, num_blocks=64, policy="chunked", chunk=0, budget=512, mode="recompute",
            prefix_caching=False, num_host_blocks=64, overlap=False):
    config = EngineConfig(
        model=ModelConfig(name=MODEL, attention_backend="xla"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, num_host_blocks=num_host_blocks,
                          watermark=0.0, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=128,
                                  preemption_mode=mode, policy=policy, long_prefill_token_threshold=chunk,
                                  async_scheduling=overlap))
    return LLMEngine(config, executor=JaxExecutor(config))


class _Plans(EngineObserver):
    """Records every executed plan's prompt rows (request id -> prompt positions reported) and padded
    token counts (the model step compiles once per T, prompt rows or not)."""

    def __init__(self):
        self.positions = collections.defaultdict(list)
        self.shapes = set()
        self.plans_with_rows = 0

    def on_step_executed(self, engine, out, result, start, end):
        plan = out.plan
        if plan.num_seqs == 0:
            return
        rows = plan.prompt_rows
        self.shapes.add(len(plan.token_ids))
        if rows is not None:
            self.plans_with_rows += 1
            for group, first, count in rows.groups:
                self.positions[group.request_id] += range(first, first + count)


def _dense(prompts):
    """f32[B, PAD_LEN, V] log-probabilities of the next token after every prefix of every prompt."""
    tokens = np.zeros((len(prompts), PAD_LEN), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return np.asarray(dense_logprobs_fn(MODEL)(jnp.asarray(tokens)))


def _check(output, prompt, dense, k):
    """`output`'s prompt log-probabilities against the dense forward's row `dense` f32[PAD_LEN, V]."""
    assert output.prompt_logprobs is not None and len(output.prompt_logprobs) == len(prompt)
    assert output.prompt_logprobs[0] is None and output.prompt_ranks[0] is None
    for t in range(1, len(prompt)):
        entry, row, token = output.prompt_logprobs[t], dense[t - 1], prompt[t]
        assert next(iter(entry)) == token  # the prompt's token first, as vLLM builds the dict
        np.testing.assert_allclose(entry[token], row[token], atol=2e-5)
        top = np.argsort(-row, kind="stable")[:k].tolist()
        assert list(entry)[1:] == [i for i in top if i != token] or list(entry) == [token] + top, (t, entry, top)
        for i in top:
            np.testing.assert_allclose(entry[i], row[i], atol=2e-5)
        assert output.prompt_ranks[t] == int((row >= row[token]).sum())


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(1, 256, size=n).tolist() for n in (2, 9, 17, 30, 41, 12)]


def _ask(engine, prompts, ks, max_tokens=4, **params):
    for i, (p, k) in enumerate(zip(prompts, ks)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=max_tokens, prompt_logprobs=k, **params))
    return run_to_end(engine)


KS = [3, 0, 5, None, 1, 20]  # one request does not ask


@pytest.mark.parametrize("policy,chunk,budget,overlap", [("chunked", 0, 512, False), ("chunked", 7, 24, False),
                                                         ("paper", 0, 512, False), ("chunked", 7, 24, True)],
                         ids=["whole", "chunks", "paper", "chunks-overlapped"])
def test_prompt_logprobs_match_dense(prompts, policy, chunk, budget, overlap):
    # overlapped (async_scheduling): decode steps run ahead beside the chunks; the executor's launch / collect split
    engine = _engine(policy=policy, chunk=chunk, budget=budget, overlap=overlap)
    plans = _Plans()
    engine.observers.append(plans)
    outputs = _ask(engine, prompts, KS)
    dense = _dense(prompts)
    for i, (p, k) in enumerate(zip(prompts, KS)):
        if k is None:
            assert outputs[str(i)].prompt_logprobs is None and str(i) not in plans.positions
            continue
        _check(outputs[str(i)], p, dense[i], k)
        assert plans.positions[str(i)] == list(range(1, len(p)))  # each position computed once, in order
    if chunk:
        assert max(len(v) for v in plans.positions.values()) > chunk  # some prompt spanned several steps


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_prompt_logprobs_through_preemption(prompts, mode):
    """A pool of about two requests preempts often, some groups mid-prompt (chunks of 5): each prompt
    position is computed for its log-probabilities once, and they equal the dense forward's."""
    engine = _engine(num_blocks=17, chunk=5, budget=16, mode=mode)
    plans = _Plans()
    engine.observers.append(plans)
    outputs = _ask(engine, prompts, [2] * len(prompts), max_tokens=40)
    assert engine.kv_stats()["num_preemptions"] > 0
    dense = _dense(prompts)
    for i, p in enumerate(prompts):
        _check(outputs[str(i)], p, dense[i], 2)
        assert plans.positions[str(i)] == list(range(1, len(p)))


def test_prompt_logprobs_with_samples_and_beams(prompts):
    """n > 1 and beam search report the prompt once, from the prefill their samples share."""
    engine = _engine()
    p = prompts[3]
    engine.add_request("n", p, SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=1, prompt_logprobs=2))
    engine.add_request("beam", p, SamplingParams(max_tokens=3, n=2, use_beam_search=True, prompt_logprobs=2))
    outputs = run_to_end(engine)
    dense = _dense([p])[0]
    for request_id in ("n", "beam"):
        _check(outputs[request_id], p, dense, 2)


def test_prefix_cache_is_not_read_for_prompt_logprobs(prompts):
    """A prompt that asks computes every position (cached ones have no logits); one that does not
    still reads the cache that both filled."""
    engine = _engine(prefix_caching=True)
    p = prompts[4]  # 41 tokens: 5 full blocks
    engine.add_request("fill", p, SamplingParams(max_tokens=2))
    run_to_end(engine)
    cached = engine.kv_stats()["prefix_cached_tokens"]
    engine.add_request("ask", p, SamplingParams(max_tokens=2, prompt_logprobs=4))
    outputs = run_to_end(engine)
    assert engine.kv_stats()["prefix_cached_tokens"] == cached  # no hit for the request that asks
    _check(outputs["ask"], p, _dense([p])[0], 4)
    engine.add_request("reuse", p, SamplingParams(max_tokens=2))
    run_to_end(engine)
    assert engine.kv_stats()["prefix_cached_tokens"] == cached + 40  # 5 blocks but the last prompt token


def test_no_cost_when_not_asked(prompts):
    """Without a request that asks, no plan carries prompt rows and every compiled step is one a plan
    needs (one per padded token count); asking compiles nothing of its own: the scores are a branch
    of the same program. (The model steps' count: the executor's num_compilations also counts
    sampler programs.)"""
    engine = _engine(chunk=7, budget=24)
    plans = _Plans()
    engine.observers.append(plans)
    _ask(engine, prompts, [None] * len(prompts))
    assert plans.plans_with_rows == 0
    assert engine.executor.runner.num_compilations == len(plans.shapes)
    before = engine.executor.runner.num_compilations
    _ask(engine, prompts, [None] * len(prompts))  # the same workload again: nothing new
    assert engine.executor.runner.num_compilations == before
    _ask(engine, prompts, [2] * len(prompts))
    assert plans.plans_with_rows > 0
    assert engine.executor.runner.num_compilations == len(plans.shapes)


def test_streamed_deltas_carry_prompt_logprobs_once(prompts):
    engine = _engine(chunk=7, budget=24)
    p = prompts[3]
    engine.add_request("d", p, SamplingParams(max_tokens=5, prompt_logprobs=1, output_kind="delta"))
    seen = []
    while engine.has_unfinished():
        seen += [o for o in engine.step() if o.request_id == "d"]
    carrying = [o for o in seen if o.prompt_logprobs is not None]
    assert len(carrying) == 1 and len(seen) > 1
    _check(carrying[0], p, _dense([p])[0], 1)


@pytest.mark.parametrize("value,error", [(21, ValueError), (-1, ValueError), (True, TypeError), ("2", TypeError),
                                         (2.0, TypeError)])
def test_prompt_logprobs_bad_values_name_the_field(value, error):
    with pytest.raises(error, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_past_the_vocabulary_is_refused():
    from jpaged.config import SchedulerConfig as Sched
    from jpaged.core.kv.block_manager import BlockManager
    from jpaged.core.sched.request_checks import check_request

    kv = BlockManager(16, 4, 0, 32, watermark=0.0, max_seqs=2)
    with pytest.raises(ValueError, match=r"sampling_params.prompt_logprobs=5 exceeds the vocabulary of 4"):
        check_request("r", [1, 2], SamplingParams(prompt_logprobs=5), None, None, scheduler=Sched(max_model_len=32),
                      kv=kv, vocab_size=4, in_use=())
