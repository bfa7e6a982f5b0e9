"""jpaged.executors.sampling: greedy tokens and the log-probabilities it returns match a full log-softmax."""

import jax
import numpy as np
import pytest

from jpaged.core.step_plan import SamplingBatch
from jpaged.executors.sampling import greedy_tokens, sample


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
    row_max = np.max(logits, axis=-1, keepdims=True)
    got = np.asarray(greedy_tokens(jax.numpy.asarray(logits), jax.numpy.asarray(row_max)))
    np.testing.assert_array_equal(got, np.asarray(jax.numpy.argmax(jax.numpy.asarray(logits), axis=-1)))
    np.testing.assert_array_equal(got[:5], [3, 0, 5, 11, 0])
