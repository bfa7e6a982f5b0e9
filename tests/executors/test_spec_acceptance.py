"""Speculative decoding's acceptance is exact: statistically, on the real sampler.

Design: a two-position model over a vocabulary of 4 tokens, p0 = p(x0) and p1 = p(x1 | x0) (a
table), and drafts (d1, d2). A verify step samples row 0 from p0 at position L and row 1 from
p(. | d1) at position L + 1, each with the key (seed, stream, position) a decode would use; the
engine's rule (`speculation.accepted_length`) keeps the drafts its samples confirm and the sample
after them. When d1 is rejected, the next step samples position L + 1 from p(. | x0). Over 8,192
seeds (one sampler call per draw kind), the emitted pairs (x0, x1) must follow p0(x0) p1(x1 | x0): a chi-square test over the 16
cells, at a 1e-4 level. The same test on two deliberately wrong rules must fail it, by far: accept
a draft whenever the target's most likely token is it; and the textbook rule done wrong, where a
rejection resamples from p instead of from p without the draft.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from jpaged.core.sched.speculation import accepted_length
from jpaged.core.step_plan import SamplingBatch
from jpaged.executors.sampling import sample

P0 = np.array([0.1, 0.45, 0.3, 0.15])
P1 = np.array([[0.7, 0.1, 0.1, 0.1], [0.05, 0.05, 0.6, 0.3], [0.25, 0.25, 0.25, 0.25], [0.4, 0.3, 0.2, 0.1]])
DRAFTS = [1, 2]  # d1 is p0's likeliest token (accepted 45% of the time), d2 p1[1]'s
DRAWS = 8192
POSITION = 40
TABLE = np.vstack([P1, P0])  # the logits rows: p(. | t) at row t, p0 at row 4 (one sampler program)


def _draws(logits_rows: np.ndarray, position: int) -> np.ndarray:
    """One draw per seed 0 .. DRAWS - 1, seed s from `TABLE[logits_rows[s]]`, at `position`: the sampler's."""
    batch = SamplingBatch(logits_rows=logits_rows.astype(np.int32), temperature=np.ones(DRAWS, np.float32),
                          top_k=np.zeros(DRAWS, np.int32), top_p=np.ones(DRAWS, np.float32),
                          seed=np.arange(DRAWS, dtype=np.uint32), stream=np.full(DRAWS, 3, np.int32),
                          position=np.full(DRAWS, position, np.int32))
    return sample(jnp.asarray(np.log(TABLE), jnp.float32), batch).token_ids


@functools.cache
def _verify_draws() -> tuple[np.ndarray, np.ndarray]:
    """(x0 i32[DRAWS], after i32[4, DRAWS]): row 0 of the verify step, and position L + 1's draw
    given each token t at L: row 1 of the verify step is after[d1]; when d1 is rejected, the next
    step's decode of position L + 1 is after[x0] (the same key: a pure function of the position)."""
    return _draws(np.full(DRAWS, 4), POSITION), np.stack([_draws(np.full(DRAWS, t), POSITION + 1) for t in range(4)])


def _emitted(rule) -> np.ndarray:
    """i64[DRAWS, 2] the first two tokens the engine emits under acceptance `rule`."""
    x0, after = _verify_draws()
    return np.array([rule(DRAFTS, [int(x0[i]), int(after[DRAFTS[0], i])], lambda t, i=i: int(after[t, i]), i)
                     for i in range(DRAWS)])


def engine_rule(drafts, sampled, next_draw, seed):
    """The engine's: the confirmed drafts and the sample after them."""
    emitted = sampled[: accepted_length(drafts[:1], sampled) + 1]
    return emitted if len(emitted) == 2 else [emitted[0], next_draw(emitted[0])]


def accept_the_likeliest(drafts, sampled, next_draw, seed):
    """Wrong: keep a draft whenever it is the target's most likely token."""
    if drafts[0] == int(P0.argmax()):
        return [drafts[0], sampled[1]]
    return [sampled[0], next_draw(sampled[0])]


def resample_without_removing(drafts, sampled, next_draw, seed):
    """Wrong: accept with probability p(d), and on rejection resample from p itself."""
    rng = np.random.default_rng(seed)
    if rng.random() < P0[drafts[0]]:
        return [drafts[0], sampled[1]]
    token = int(rng.choice(4, p=P0))
    return [token, next_draw(token)]


def _p_value(pairs: np.ndarray) -> float:
    observed = np.zeros((4, 4))
    np.add.at(observed, (pairs[:, 0], pairs[:, 1]), 1)
    expected = P0[:, None] * P1 * len(pairs)
    return scipy_stats.chisquare(observed.ravel(), expected.ravel()).pvalue


def test_the_engines_rule_samples_the_target_distribution():
    assert _p_value(_emitted(engine_rule)) > 1e-4


@pytest.mark.parametrize("wrong_rule", [accept_the_likeliest, resample_without_removing])
def test_the_test_rejects_a_wrong_acceptance_rule(wrong_rule):
    assert _p_value(_emitted(wrong_rule)) < 1e-12
