"""jpaged.executors.sampling: greedy tokens and their log-probabilities match a full log-softmax; the
random draw follows vLLM's distribution for every filter, row by row whatever the batch; the
controls give vLLM's processed logits exactly."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.core.sampling_controls import build_controls
from jpaged.core.sequence import SamplingParams, Sequence, SequenceGroup
from jpaged.core.step_plan import SamplingBatch
from jpaged.executors.logits_controls import ControlWidths, apply_controls, padded_controls
from jpaged.executors.sampling import SamplerWidths, greedy_tokens
from jpaged.executors.sampling import sample as sample_at_widths

# One set of per-row widths for every call here, as an engine has: the sampler's program then
# depends only on the logits' shape, and the tests that share a shape share one compiled program.
WIDTHS = SamplerWidths(ControlWidths(history=64, bias=8, banned=64), num_top=8)


def sample(logits, batch):
    """jpaged.executors.sampling.sample at this file's fixed widths."""
    return sample_at_widths(logits, batch, WIDTHS)


def _batch(rows: list[int], temperature: float = 0.0, num_top: int = 0) -> SamplingBatch:
    zeros = np.zeros(len(rows), np.int32)
    return SamplingBatch(logits_rows=np.asarray(rows, np.int32), temperature=np.full(len(rows), temperature, np.float32),
                         top_k=zeros, top_p=np.ones(len(rows), np.float32), seed=zeros.astype(np.uint32),
                         stream=zeros, position=zeros, num_top=num_top)


@pytest.mark.parametrize("num_top", [0, 3])
def test_greedy_tokens_and_logprobs_match_log_softmax(num_top):
    logits = np.random.default_rng(0).normal(size=(5, 1000)).astype(np.float32) * 4
    rows = [4, 0, 2]
    result = sample(jax.numpy.asarray(logits), _batch(rows, num_top=num_top))
    full = np.asarray(jax.nn.log_softmax(logits[rows], axis=-1))
    np.testing.assert_array_equal(result.token_ids, logits[rows].argmax(-1))
    np.testing.assert_allclose(result.logprobs, full[np.arange(3), result.token_ids], rtol=1e-6, atol=1e-6)
    if num_top:
        order = np.argsort(-full, axis=-1)[:, :num_top]
        np.testing.assert_array_equal(result.top_ids, order)
        np.testing.assert_allclose(result.top_logprobs, np.take_along_axis(full, order, -1), rtol=1e-6, atol=1e-6)


def test_sampled_token_logprob_is_that_tokens():
    logits = np.random.default_rng(1).normal(size=(2, 64)).astype(np.float32)
    result = sample(jax.numpy.asarray(logits), _batch([0, 1], temperature=1.0))
    full = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(result.logprobs, full[np.arange(2), result.token_ids], rtol=1e-6, atol=1e-6)


def test_greedy_tokens_equal_argmax_on_ties_infinities_and_nan():
    logits = np.random.default_rng(2).normal(size=(6, 50)).astype(np.float32)
    logits[0, [3, 7, 40]] = 9.0  # a three-way tie: the first index wins
    logits[1] = -np.inf  # every token impossible
    logits[2, [5, 30]] = np.inf
    logits[3, [11, 20]] = np.nan  # argmax returns the first NaN
    logits[4, 0] = np.nan
    logits[5, [2, 30]] = [np.nan, 50.0]  # the first NaN, also before the max
    got = np.asarray(greedy_tokens(jax.numpy.asarray(logits), jax.numpy.asarray(True)))
    np.testing.assert_array_equal(got, np.asarray(jax.numpy.argmax(jax.numpy.asarray(logits), axis=-1)))
    np.testing.assert_array_equal(got, [3, 0, 5, 11, 0, 2])


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([4096, 4000, 96, 50, 1000, 31]), st.integers(1, 9), st.integers(0, 2 ** 31 - 1))
def test_greedy_tokens_by_blocks_equal_argmax(vocab, rows, seed):
    """The block pass (and jnp.argmax where no divisor from 16 to 128 exists), on NaN-free rows against
    np.argmax, on rows with ties of the max across and inside blocks, and infinities."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(-4, 4, size=(rows, vocab)).astype(np.float32)  # small integers: many ties
    logits[rng.random((rows, vocab)) < 0.01] = np.inf
    logits[rng.random((rows, vocab)) < 0.3] = -np.inf
    got = np.asarray(greedy_tokens(jax.numpy.asarray(logits), jax.numpy.asarray(False)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))


# ---------------------------------------------------------------- the random draw against vLLM's definition


def softmax(x):
    e = np.exp(x - np.max(x))
    return e / e.sum()


def vllm_probs(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """vLLM v1's sampling distribution, written out in numpy: temperature, min_p on the
    probabilities, top-k keeping every logit >= the k-th, top-p over the ascending cumulative sum
    of what is left (vllm/v1/sample/ops/topk_topp_sampler.py, apply_top_k_top_p_pytorch)."""
    x = logits.astype(np.float64) / temperature
    if min_p:
        probs = softmax(x)
        x = np.where(probs < min_p * probs.max(), -np.inf, x)
    if top_k:
        x = np.where(x < np.sort(x)[-top_k], -np.inf, x)
    if top_p < 1:
        order = np.argsort(x, kind="stable")
        cumulative = np.cumsum(softmax(x[order]))
        drop = cumulative <= 1 - top_p
        drop[-1] = False
        x[order[drop]] = -np.inf
    return softmax(x)


def draws(logits_row, num, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5, position=3):
    """`num` seeded draws from one logits row (streams 0 .. num - 1)."""
    z = np.zeros(num, np.int32)
    batch = SamplingBatch(logits_rows=z, temperature=np.full(num, temperature, np.float32),
                          top_k=np.full(num, top_k, np.int32), top_p=np.full(num, top_p, np.float32),
                          seed=np.full(num, seed, np.uint32), stream=np.arange(num, dtype=np.int32),
                          position=z + position, min_p=np.full(num, min_p, np.float32))
    return sample(jax.numpy.asarray(logits_row[None]), batch).token_ids


# Every path: the full vocabulary (temperature alone, min_p, top-p by bisection, top-k above the
# candidate limit), and the candidates (0 < top_k <= 64, with top-p and min_p over them).
DRAW_CASES = [{}, {"temperature": 0.6}, {"min_p": 0.1}, {"top_p": 0.8}, {"top_p": 0.5, "min_p": 0.02},
              {"top_k": 100}, {"top_k": 100, "top_p": 0.9, "temperature": 2.0}, {"top_k": 5}, {"top_k": 40, "top_p": 0.7},
              {"top_k": 20, "min_p": 0.05, "temperature": 1.5}]


@pytest.mark.parametrize("settings", DRAW_CASES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "T=1")
def test_draws_follow_vllms_distribution(settings):
    """8,192 seeded draws (the support-set tests' row count: one sampler program for both):
    nothing outside the support, and a total-variation distance from the reference within 1.5 x
    what sampling noise gives on average (without the filter the distance is 0.2-0.86)."""
    logits = np.random.default_rng(3).normal(size=300).astype(np.float32)
    expected = vllm_probs(logits, **{"temperature": 1.0, **settings})
    num = 8192
    got = draws(logits, num, **settings)
    assert set(got.tolist()) <= set(np.flatnonzero(expected).tolist())
    empirical = np.bincount(got, minlength=len(logits)) / num
    noise = 0.5 * np.sqrt(2 / np.pi / num) * np.sqrt(expected * (1 - expected)).sum()  # E|p^ - p| summed, halved
    assert 0.5 * np.abs(empirical - expected).sum() < 1.5 * noise


@pytest.mark.parametrize("settings, size", [({"top_k": 7}, 7), ({"top_k": 90}, 90), ({"min_p": 0.5}, None),
                                            ({"top_p": 0.3}, None), ({"top_k": 30, "top_p": 0.5}, None)])
def test_support_sets_are_exact(settings, size):
    """At a high temperature every kept token is likely enough to be drawn: the drawn set is the
    reference support exactly (top-k's k tokens, min_p's and top-p's sets)."""
    logits = np.random.default_rng(4).normal(size=300).astype(np.float32) * 40  # no near ties
    temperature = 40.0
    support = set(np.flatnonzero(vllm_probs(logits, temperature, **settings)).tolist())
    assert size is None or len(support) == size
    assert 3 <= len(support) <= 120
    assert set(draws(logits, 8192, temperature, **settings).tolist()) == support


def test_top_k_above_the_candidate_limit_keeps_the_ties_of_the_kth():
    logits = np.linspace(10.0, 0.0, 300).astype(np.float32)  # (300: the other draws' vocabulary)
    logits[60:75] = logits[60]  # 15 tokens tied across the 70th place
    got = set(draws(logits, 8192, temperature=100.0, top_k=70).tolist())
    assert got == set(range(75))


def test_a_rows_draw_does_not_depend_on_the_rest_of_its_batch():
    """Rows drawn alone and among rows that change every static choice of the step: the
    candidate width (16 -> 64), the full-vocabulary top-k and top-p passes (off -> on, and on ->
    on with candidates beside them), a greedy row, the controls. Each row keeps its logits,
    settings, seed, stream and position; its token must not move."""
    logits = np.random.default_rng(5).normal(size=(40, 500)).astype(np.float32) * 3
    # (temperature, top_k, top_p, min_p): group A needs candidates of width 16 and nothing else,
    # group B the full-vocabulary passes and no candidates.
    group_a = [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 12, 0.8, 0.1), (0.9, 0, 1.0, 0.2), (1.1, 16, 0.95, 0.0),
               (0.5, 3, 0.6, 0.05)] * 2
    group_b = [(1.3, 0, 0.9, 0.0), (1.0, 200, 1.0, 0.0), (0.5, 0, 0.6, 0.05), (1.0, 100, 0.7, 0.0)] * 2

    def batch(rows):
        t, k, p, m = (np.array(v) for v in zip(*[s for s, _ in rows]))
        return SamplingBatch(logits_rows=np.array([r for _, r in rows], np.int32), temperature=t.astype(np.float32),
                             top_k=k.astype(np.int32), top_p=p.astype(np.float32),
                             seed=np.full(len(rows), 9, np.uint32), stream=np.array([r * 7 for _, r in rows], np.int32),
                             position=np.array([r + 1 for _, r in rows], np.int32), min_p=m.astype(np.float32))

    a = [(s, r) for r, s in enumerate(group_a)]
    b = [(s, r) for r, s in enumerate(group_b, len(group_a))]
    a_alone = sample(jax.numpy.asarray(logits), batch(a)).token_ids
    b_alone = sample(jax.numpy.asarray(logits), batch(b)).token_ids
    others = [((1.0, 60, 1.0, 0.0), 30), ((0.0, 0, 1.0, 0.0), 31), ((2.0, 300, 0.5, 0.0), 32), ((1.0, 0, 0.3, 0.0), 33)]
    crowd = batch(others[:2] + a + others[2:] + b)
    crowd.controls = build_controls_for_rows(len(crowd.logits_rows), {0: {"presence_penalty": 1.0}})
    together = sample(jax.numpy.asarray(logits), crowd).token_ids
    np.testing.assert_array_equal(together[2: 2 + len(a)], a_alone)
    np.testing.assert_array_equal(together[4 + len(a):], b_alone)


def build_controls_for_rows(num_rows, params_by_row):
    """SamplingControls for `num_rows` rows of fresh requests, row r with SamplingParams(**params_by_row[r])."""
    seqs = []
    for r in range(num_rows):
        seq = Sequence(r, [1, 2, 3])
        SequenceGroup(f"r{r}", [seq], SamplingParams(**params_by_row.get(r, {})), 0.0, r)
        seq.token_ids += [3, 4]
        seqs.append(seq)
    return build_controls(seqs)


# ---------------------------------------------------------------- the controls against vLLM's arithmetic


def vllm_processed(logits, prompt, output, *, presence=0.0, frequency=0.0, repetition=1.0, bias=None, banned=(),
                   allowed=None):
    """vLLM v1's processed logits in float32 numpy, in its order: allowed tokens, banned tokens,
    logit_bias, repetition (x 1/penalty where positive, x penalty elsewhere, over prompt and output),
    frequency and presence (over the output)."""
    x = logits.astype(np.float32).copy()
    if allowed is not None:
        keep = np.zeros(len(x), bool)
        keep[list(allowed)] = True
        x[~keep] = -np.inf
    x[list(banned)] = -np.inf
    for token, b in (bias or {}).items():
        x[token] += np.float32(b)
    counts = np.bincount(output, minlength=len(x))
    seen = (np.bincount(prompt, minlength=len(x)) > 0) | (counts > 0)
    penalty = np.where(seen, np.float32(repetition), np.float32(1.0))
    x *= np.where(x > 0, np.float32(1.0) / penalty, penalty)
    x -= np.float32(frequency) * counts.astype(np.float32)
    x -= np.float32(presence) * (counts > 0).astype(np.float32)
    return x


CONTROL_ROWS = [{}, {"repetition_penalty": 1.7}, {"repetition_penalty": 0.6, "frequency_penalty": 0.4},
                {"presence_penalty": -1.5, "frequency_penalty": 2.0}, {"logit_bias": {3: 5.5, 99: -100.0, 7: 0.25}},
                {"min_tokens": 11, "stop_token_ids": [11]}, {"bad_words_token_ids": [[42], [4, 8], [5, 9]]},
                {"allowed_token_ids": list(range(0, 128, 3))},
                {"repetition_penalty": 1.2, "presence_penalty": 0.5, "logit_bias": {4: 1.0}, "allowed_token_ids": [4, 5, 6, 60]}]


def test_controls_give_vllms_logits_exactly():
    rng = np.random.default_rng(6)
    vocab = 128
    logits = rng.normal(size=(len(CONTROL_ROWS), vocab)).astype(np.float32) * 4
    prompts = [rng.integers(0, vocab, 12).tolist() for _ in CONTROL_ROWS]
    outputs = [rng.integers(0, vocab, 9).tolist() + [4] for _ in CONTROL_ROWS]
    seqs = []
    for r, (settings, prompt, output) in enumerate(zip(CONTROL_ROWS, prompts, outputs)):
        seq = Sequence(r, prompt)
        SequenceGroup(f"r{r}", [seq], SamplingParams(**settings), 0.0, r, eos_token_ids=(2,))
        seq.token_ids += output
        seqs.append(seq)
    # (lists wider than the rows need: the fixed widths of an engine's limits change no logit)
    controls = padded_controls(build_controls(seqs), 16, vocab, ControlWidths(history=256, bias=16, banned=32))
    padded = np.zeros((16, vocab), np.float32)
    padded[: len(seqs)] = logits
    got = np.asarray(apply_controls(jax.numpy.asarray(padded), controls))
    for r, (settings, prompt, output) in enumerate(zip(CONTROL_ROWS, prompts, outputs)):
        banned = []
        if settings.get("min_tokens"):
            banned += [2] + settings["stop_token_ids"]
        if settings.get("bad_words_token_ids"):
            banned += [42, 8]  # the output ends with 4
        expected = vllm_processed(logits[r], prompt, output, presence=settings.get("presence_penalty", 0.0),
                                  frequency=settings.get("frequency_penalty", 0.0),
                                  repetition=settings.get("repetition_penalty", 1.0), bias=settings.get("logit_bias"),
                                  banned=banned, allowed=settings.get("allowed_token_ids"))
        np.testing.assert_array_equal(got[r], expected, err_msg=str(settings))
    np.testing.assert_array_equal(got[len(seqs):], 0.0)  # padding rows untouched


def test_greedy_rows_take_the_argmax_of_processed_logits_and_report_raw_logprobs():
    rng = np.random.default_rng(7)
    logits = rng.normal(size=(3, 64)).astype(np.float32)
    top = logits.argmax(-1)
    batch = _batch([0, 1, 2])
    batch.controls = build_controls_for_rows(3, {0: {"logit_bias": {int(top[0]): -100.0}},
                                                 2: {"allowed_token_ids": [5, 6]}})
    result = sample(jax.numpy.asarray(logits), batch)
    second = np.argsort(-logits[0])[1]
    assert result.token_ids.tolist() == [second, top[1], 5 + int(logits[2, 6] > logits[2, 5])]
    full = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(result.logprobs, full[np.arange(3), result.token_ids], rtol=1e-6, atol=1e-6)


def test_a_random_row_with_every_token_masked_takes_the_argmax():
    """Nothing left to draw from (every token banned): the row takes the argmax of its processed
    logits, the first token, rather than a garbage index; a row with one token left draws it."""
    logits = np.random.default_rng(8).normal(size=(2, 64)).astype(np.float32)
    batch = _batch([0, 1], temperature=1.0)
    batch.controls = build_controls_for_rows(2, {0: {"bad_words_token_ids": [[t] for t in range(64)]},
                                                 1: {"allowed_token_ids": [9]}})
    assert sample(jax.numpy.asarray(logits), batch).token_ids.tolist() == [0, 9]
