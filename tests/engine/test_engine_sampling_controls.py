"""The sampling controls through the real engine: every control's seeded output is the same alone, in
a crowd and under preemption (swap and recompute, both policies); neutral values change no greedy
token; each control has its effect; best_of returns the n best; the structured-output seam, with
hand-written constraints and with llguidance grammars over a byte-level tokenizer of the vocabulary."""

import functools
import json
import re

import numpy as np
import pytest

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.core.constraints import StructuredOutputsParams as SOP
from jpaged.core.sequence import SamplingParams as SP
from jpaged.engine import LLMEngine
from jpaged.executors.jax import JaxExecutor
from jpaged.text.structured_output import compiler_for
from tests.helpers.constraints import BrokenConstraint, DigitsThenEos, byte_tokenizer
from tests.helpers.json_schema import errors

EOS = 3
DIGITS = range(20, 30)
BYTES = byte_tokenizer(EOS)  # token b is byte b (but EOS): llguidance grammars over tiny-llama's vocabulary
OBJECT = {"type": "object", "properties": {"n": {"type": "integer"}, "tag": {"enum": ["a", "bc"]}},
          "required": ["n", "tag"], "additionalProperties": False}


def engine(*, block_size=16, num_blocks=64, num_host_blocks=0, mode="recompute", policy="chunked",
           max_num_batched_tokens=512):
    """tiny-llama (vocabulary 256, EOS id 3) with the given pool and scheduler."""
    config = EngineConfig(
        model=ModelConfig(name="tiny-llama", attention_backend="xla"),
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, num_host_blocks=num_host_blocks),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=max_num_batched_tokens, max_model_len=256,
                                  preemption_mode=mode, policy=policy))
    return LLMEngine(config, executor=_executor(config), eos_token_ids=(EOS,))


@functools.cache
def _executor(config):
    """One executor per config (its compiled steps are kept across the tests' engines)."""
    return JaxExecutor(config)


def serve(eng, requests, max_steps=2000):
    """Adds (request_id, prompt, params) in order, steps until done, checks every block came back."""
    for request_id, prompt, params in requests:
        eng.add_request(request_id, prompt, params)
    outputs = {}
    for _ in range(max_steps):
        outputs.update({o.request_id: o for o in eng.step() if o.finished})
        if not eng.has_unfinished():
            break
    assert not eng.has_unfinished()
    stats = eng.kv_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_host_blocks"]
    return outputs


def tokens_of(outputs):
    return {k: (o.output_token_ids, [c.finish_reason for c in o.outputs], o.error) for k, o in outputs.items()}


def controlled():
    """One seeded request per control (a fresh constraint each call: it is stateful)."""
    return [
        ("pen", list(range(3, 40)), SP(max_tokens=14, temperature=0.9, seed=1, repetition_penalty=1.4,
                                       presence_penalty=0.6, frequency_penalty=0.4)),
        ("greedy-pen", list(range(50, 70)), SP(max_tokens=12, repetition_penalty=1.8, frequency_penalty=1.0)),
        ("bias", list(range(9, 30)), SP(max_tokens=10, temperature=1.0, seed=2, logit_bias={5: 4.0, 17: -100.0})),
        ("min-tokens", list(range(7, 31)), SP(max_tokens=12, temperature=1.0, seed=3, min_tokens=9,
                                              stop_token_ids=list(range(100, 180)))),
        ("min-p", list(range(11, 47)), SP(max_tokens=12, temperature=1.2, seed=4, min_p=0.3, top_k=30)),
        ("allowed", list(range(60, 81)), SP(max_tokens=10, temperature=1.0, seed=5, allowed_token_ids=range(40, 90))),
        ("bad", list(range(30, 55)), SP(max_tokens=10, temperature=1.0, seed=6,
                                        bad_words_token_ids=[[40], [41, 42], [7, 8, 9]])),
        ("best-of", list(range(90, 113)), SP(n=2, best_of=4, max_tokens=9, temperature=1.0, seed=7)),
        ("grammar", list(range(4, 26)), SP(max_tokens=8, temperature=1.0, seed=8,
                                           constraint=DigitsThenEos(DIGITS, EOS, 256, max_digits=5))),
        ("top-p", list(range(120, 150)), SP(max_tokens=12, temperature=0.8, top_p=0.7, seed=9)),
        ("json", list(range(33, 61)), SP(max_tokens=40, temperature=1.0, seed=10, constraint=compiler_for(
            BYTES).constraint(SOP(json=OBJECT, disable_any_whitespace=True)))),
        ("regex-n2", list(range(70, 99)), SP(n=2, max_tokens=8, temperature=1.0, seed=11, constraint=compiler_for(
            BYTES).constraint(SOP(regex="[0-9a-f]{2,6}")))),
    ]


@functools.cache
def _alone():
    """Each controlled request served alone on a roomy pool."""
    eng = engine()
    return {request[0]: tokens_of(serve(eng, [request]))[request[0]] for request in controlled()}


# Both policies and both preemption modes by default; the other pairings, the roomy crowd and small
# chunks with -m slow (each setting compiles its own step shapes: tens of seconds on 2 cores).
@pytest.mark.parametrize("setting", [
    {"num_blocks": 10, "mode": "recompute"},
    {"num_blocks": 10, "num_host_blocks": 40, "mode": "swap", "policy": "paper"},
    pytest.param({"num_blocks": 10, "num_host_blocks": 40, "mode": "swap"}, marks=pytest.mark.slow),
    pytest.param({"num_blocks": 10, "mode": "recompute", "policy": "paper"}, marks=pytest.mark.slow),
    pytest.param({}, marks=pytest.mark.slow),
    pytest.param({"num_blocks": 40, "block_size": 8, "max_num_batched_tokens": 24}, marks=pytest.mark.slow),
], ids=["recompute", "paper-swap", "swap", "paper-recompute", "crowd", "chunk24"])
def test_every_control_is_seeded_alone_in_a_crowd_and_under_preemption(setting):
    eng = engine(**setting)
    got = tokens_of(serve(eng, controlled()))
    if setting.get("num_blocks") == 10:
        assert eng.kv_stats()["num_preemptions"] > 0
    assert got == _alone()
    (json_ids,), finish, _ = got["json"]  # the grammars' outputs are complete and valid
    assert finish == ["stop"] and errors(json.loads(BYTES.decode(json_ids)), OBJECT) == []
    assert all(re.fullmatch("[0-9a-f]{2,6}", BYTES.decode(ids)) for ids in got["regex-n2"][0])


def test_neutral_controls_change_no_greedy_token():
    """Neutral values run the plain path or leave the logits bit for bit as they were: a greedy
    request is the same with them, also beside a request whose controls send the whole step down
    the control path (an allowed set of the whole vocabulary, zero biases)."""
    prompt = list(range(5, 33))
    plain = SP(max_tokens=16)
    neutral = SP(max_tokens=16, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias={},
                 min_tokens=0, min_p=0.0, best_of=1, bad_words=(), bad_words_token_ids=())
    whole = SP(max_tokens=16, allowed_token_ids=range(256), logit_bias={7: 0.0, 8: -0.0}, min_tokens=1,
               stop_token_ids=[255])
    eng = engine()
    reference = serve(eng, [("a", prompt, plain)])["a"].output_token_ids
    got = serve(eng, [("b", prompt, neutral), ("c", prompt, whole), ("d", list(range(40, 60)), SP(
        max_tokens=16, repetition_penalty=2.0, temperature=1.0, seed=1))])
    assert got["b"].output_token_ids == reference
    assert got["c"].output_token_ids == reference


def test_each_control_has_its_effect():
    eng = engine()
    prompt = list(range(5, 33))
    greedy = serve(eng, [("g", prompt, SP(max_tokens=12))])["g"].output_token_ids[0]
    first, second = greedy[0], greedy[1]
    got = serve(eng, [
        ("bias", prompt, SP(max_tokens=6, logit_bias={77: 100.0})),
        ("allowed", prompt, SP(max_tokens=12, temperature=1.0, seed=1, allowed_token_ids=[60, 61, 62])),
        ("bad-one", prompt, SP(max_tokens=3, bad_words_token_ids=[[first]])),
        ("bad-two", prompt, SP(max_tokens=3, bad_words_token_ids=[[first, second]])),
        ("rep", prompt, SP(max_tokens=12, repetition_penalty=100.0)),
    ])
    assert got["bias"].output_token_ids == [[77] * 6]
    assert set(got["allowed"].output_token_ids[0]) <= {60, 61, 62}
    assert got["bad-one"].output_token_ids[0][0] != first
    bad_two = got["bad-two"].output_token_ids[0]
    assert bad_two[0] == first and bad_two[1] != second
    rep = got["rep"].output_token_ids[0]  # a huge penalty: no token of the prompt or of its own output again
    assert len(set(rep)) == len(rep) and not set(rep) & set(prompt)


def test_min_tokens_masks_stop_ids_and_eos_until_reached():
    eng = engine()
    prompt = list(range(5, 33))
    greedy = serve(eng, [("g", prompt, SP(max_tokens=12))])["g"].output_token_ids[0]
    stop = greedy[1]  # greedy emits it second: without min_tokens the output ends there
    early = serve(eng, [("a", prompt, SP(max_tokens=12, stop_token_ids=[stop]))])["a"]
    assert early.output_token_ids[0] == greedy[:2] and early.outputs[0].finish_reason == "stop"
    late = serve(eng, [("b", prompt, SP(max_tokens=12, stop_token_ids=[stop, EOS], min_tokens=6))])["b"]
    tokens = late.outputs[0].token_ids
    assert len(tokens) >= 6 and not {stop, EOS} & set(tokens[:6])
    assert late.outputs[0].finish_reason == ("stop" if len(tokens) < 12 else "length")


def test_best_of_returns_the_n_best_samples_and_frees_the_rest():
    eng = engine()
    prompt = list(range(90, 113))
    every = serve(eng, [("all", prompt, SP(n=5, max_tokens=9, temperature=1.0, seed=7))])["all"]
    best = serve(eng, [("best", prompt, SP(n=2, best_of=5, max_tokens=9, temperature=1.0, seed=7))])["best"]
    ranked = sorted(every.outputs, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in best.outputs] == [c.token_ids for c in ranked]
    assert [c.index for c in best.outputs] == [0, 1]
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob
    np.testing.assert_allclose([c.cumulative_logprob for c in best.outputs], [c.cumulative_logprob for c in ranked])


def test_a_constraint_shapes_the_output_and_ends_it():
    eng = engine()
    got = serve(eng, [
        ("digits", list(range(4, 26)), SP(max_tokens=10, temperature=1.0, seed=11,
                                          constraint=DigitsThenEos(DIGITS, EOS, 256, min_digits=2, max_digits=4))),
        ("short", list(range(4, 26)), SP(max_tokens=2, temperature=1.0, seed=11,
                                         constraint=DigitsThenEos(DIGITS, EOS, 256, min_digits=3))),
        ("three", list(range(4, 26)), SP(n=3, max_tokens=10, temperature=1.0, seed=12,
                                         constraint=DigitsThenEos(DIGITS, 200, 256, min_digits=1, max_digits=3))),
        ("plain", list(range(4, 26)), SP(max_tokens=5)),
    ])
    digits = got["digits"].outputs[0]
    assert 3 <= len(digits.token_ids) <= 5 and set(digits.token_ids[:-1]) <= set(DIGITS)
    assert digits.token_ids[-1] == EOS and digits.finish_reason == "stop"
    short = got["short"].outputs[0]  # max_tokens first: "length", never claimed complete
    assert short.finish_reason == "length" and set(short.token_ids) <= set(DIGITS) and len(short.token_ids) == 2
    for sample in got["three"].outputs:  # each sample its own matcher; the constraint's end (200) is no stop id
        assert sample.finish_reason == "stop" and sample.token_ids[-1] == 200
        assert 1 <= len(sample.token_ids) - 1 <= 3 and set(sample.token_ids[:-1]) <= set(DIGITS)
    assert len({tuple(s.token_ids) for s in got["three"].outputs}) > 1
    assert got["plain"].error is None and len(got["plain"].outputs[0].token_ids) == 5


def test_a_broken_constraint_fails_its_request_alone():
    eng = engine()
    alone = serve(eng, [("ok", list(range(8, 30)), SP(max_tokens=6, temperature=1.0, seed=3))])["ok"]
    got = serve(eng, [("broken", list(range(4, 26)), SP(max_tokens=6, constraint=BrokenConstraint(DIGITS, EOS, 256))),
                      ("ok", list(range(8, 30)), SP(max_tokens=6, temperature=1.0, seed=3))])
    assert "grammar exploded" in got["broken"].error
    assert got["ok"].error is None and got["ok"].output_token_ids == alone.output_token_ids
