"""What the engine core offers the text front end: per-token logprobs, EOS ids (ignore_eos keeps
explicit stop ids), finish_request (a stop string found outside the core), seeds that do not
depend on the request id, and an observer hook per finished request."""

import numpy as np
import pytest

from jpaged.core.sequence import SamplingParams, SequenceStatus
from jpaged.engine import EngineObserver
from tests.helpers.tiny_engines import dense_next_logprobs, make_engine

PROMPT = [7, 99, 3, 42, 11, 250, 18]


@pytest.fixture(scope="module")
def engine():
    """One engine for the module (each test's requests have their own ids; each leaves it idle)."""
    return make_engine()


def run(engine, request_id="r", prompt=PROMPT, **params):
    engine.add_request(request_id, prompt, SamplingParams(**params))
    finals = {}
    for _ in range(200):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        if not engine.has_unfinished():
            break
    return finals[request_id]


def test_logprobs_are_the_models_top_k_and_sampled_token(engine):
    out = run(engine, max_tokens=5, logprobs=3)
    completion = out.outputs[0]
    assert len(completion.logprobs) == 5
    for t, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        dense = dense_next_logprobs("tiny-opt", [PROMPT + completion.token_ids[:t]])[0]
        top = np.argsort(-dense)[:3]
        assert list(entry)[:3] == top.tolist()  # best first
        np.testing.assert_allclose([entry[i] for i in top.tolist()], dense[top], atol=1e-4)
        assert token == top[0]  # greedy
    assert completion.cumulative_logprob == pytest.approx(sum(e[t] for t, e in zip(completion.token_ids,
                                                                                     completion.logprobs)), abs=1e-4)


def test_logprobs_of_samples_are_unscaled_and_per_fork(engine):
    out = run(engine, n=2, temperature=1.5, seed=3, max_tokens=6, logprobs=0)
    for completion in out.outputs:
        assert len(completion.logprobs) == 6 and all(len(e) == 1 for e in completion.logprobs)
        for t, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            dense = dense_next_logprobs("tiny-opt", [PROMPT + completion.token_ids[:t]])[0]
            assert entry[token] == pytest.approx(float(dense[token]), abs=1e-4)  # the model's, not temperature's
    assert run(engine, max_tokens=3).outputs[0].logprobs is None


def test_delta_logprobs_add_up_to_the_final_ones(engine):
    engine.add_request("d", PROMPT, SamplingParams(max_tokens=6, logprobs=2, output_kind="delta"))
    tokens, logprobs = [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.outputs[0].token_ids
            logprobs += out.outputs[0].logprobs
    final = run(engine, max_tokens=6, logprobs=2).outputs[0]
    assert tokens == final.token_ids and logprobs == final.logprobs


def test_eos_ids_stop_unless_ignore_eos_and_stop_token_ids_always_stop(engine):
    free_run = run(engine, max_tokens=12, ignore_eos=True).outputs[0].token_ids
    eos = free_run[4]
    cut = free_run.index(eos) + 1
    engine.eos_token_ids = (eos,)  # what LLM / AsyncLLMEngine pass from the tokenizer
    try:
        stopped = run(engine, "a", max_tokens=12).outputs[0]
        ignoring = run(engine, "b", max_tokens=12, ignore_eos=True).outputs[0]
    finally:
        engine.eos_token_ids = ()
    assert stopped.token_ids == free_run[:cut] and stopped.finish_reason == "stop"
    assert ignoring.token_ids == free_run and ignoring.finish_reason == "length"
    explicit = run(engine, "c", max_tokens=12, ignore_eos=True, stop_token_ids=(eos,)).outputs[0]
    assert explicit.token_ids == free_run[:cut] and explicit.finish_reason == "stop"


def test_finish_request_ends_samples_and_frees_their_blocks(engine):
    bm = engine.scheduler.block_manager
    engine.add_request("f", PROMPT, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=20, ignore_eos=True))
    for _ in range(3):
        engine.step()
    used = bm.num_usable_blocks - bm.num_free_blocks
    engine.finish_request("f", [1])  # sample 1 reached a stop string
    assert bm.num_usable_blocks - bm.num_free_blocks < used
    out = [o for _ in range(40) for o in engine.step() if o.finished][0]
    assert [c.finish_reason for c in out.outputs] == ["length", "stop"]
    assert len(out.outputs[0].token_ids) == 20 and len(out.outputs[1].token_ids) == 3
    assert bm.num_free_blocks == bm.num_usable_blocks
    with pytest.raises(KeyError):
        engine.finish_request("f")
    engine.add_request("w", PROMPT, SamplingParams(max_tokens=5))
    engine.finish_request("w")  # still waiting: it leaves the queue
    assert [o.outputs[0].finish_reason for o in engine.step()] == ["stop"] and not engine.has_unfinished()
    engine.add_request("x", PROMPT, SamplingParams())
    with pytest.raises(ValueError, match="finished status"):
        engine.finish_request("x", status=SequenceStatus.RUNNING)
    engine.abort("x")
    engine.step()


def test_an_explicit_seed_fixes_samples_whatever_the_request_id(engine):
    params = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    a = run(engine, "first", seed=11, **params).outputs[0].token_ids
    b = run(engine, "second", seed=11, **params).outputs[0].token_ids
    assert a == b
    c = run(engine, "first", **params).outputs[0].token_ids  # seed None: the request id decides
    d = run(engine, "second", **params).outputs[0].token_ids
    assert c != d


def test_observer_sees_every_finished_request_once(engine):
    seen = []

    class Recorder(EngineObserver):
        def on_request_finished(self, engine, group, output):
            seen.append((output.request_id, max(s.num_output_tokens for s in group.seqs)))

    recorder = Recorder()
    engine.observers.append(recorder)
    try:
        engine.add_request("x", PROMPT, SamplingParams(max_tokens=4, output_kind="delta"))
        engine.add_request("y", PROMPT, SamplingParams(max_tokens=6))
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.observers.remove(recorder)
    assert sorted(seen) == [("x", 4), ("y", 6)]


def test_sampling_params_check_the_new_fields():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(n=2, use_beam_search=True, logprobs=1)
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=("",))
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-1)
    assert SamplingParams(stop="\n").stop == ("\n",)
