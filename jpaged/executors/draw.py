"""The random draw of the sampler: temperature, min_p, top-k and top-p without sorting the vocabulary.

Each row draws from softmax(logits / T) restricted as vLLM restricts it: min_p (keep p >= min_p x
p_max), then top-k, then top-p over what is left, renormalised. Two exact paths, chosen by each
row's own top_k so that a row's token never depends on the rest of its batch:

- candidates (0 < top_k <= CANDIDATE_LIMIT): `lax.top_k` over the batch's largest k (width 16
  or 64, chosen at run time), min_p and top-p over the sorted candidates (top-p mass by a sequential scan,
  the same sums at any width), then Gumbel-max whose noise is keyed by token id: the draw is the
  same whatever the width.
- full vocabulary (every other row): one exp pass, min_p in it; top-k above the limit and top-p
  by bisection over the float bits (32 masked passes, exact, no sort); then inverse-CDF sampling
  with one uniform per row (block sums of 64 tokens, cumulative over blocks, then within the
  chosen block).

One compiled program serves every mix: each path and pass runs only when some row of the step
needs it (`lax.cond`, `lax.switch`), decided at run time from the rows' settings.
Randomness is a pure function of (seed, stream, position) and, for candidates, the token id.
Per-step costs of each path are in docs/notes/sampling.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CANDIDATE_LIMIT = 64  # largest top_k sampled among lax.top_k candidates; larger k: full-vocabulary threshold
CANDIDATE_WIDTHS = (16, CANDIDATE_LIMIT)  # the lax.top_k widths of the candidate path
_BLOCK = 64  # tokens per block of the inverse-CDF search


def row_keys(seed: jax.Array, stream: jax.Array, position: jax.Array) -> jax.Array:
    """One PRNG key per row from u32[R] seeds, i32[R] streams and i32[R] positions."""
    return jax.vmap(lambda s, t, p: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), t), p))(
        seed, stream, position)


def _ordered(x: jax.Array) -> jax.Array:
    """f32 -> u32 keys in the same order (negatives flipped below the positives)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(0x80000000))


def _largest_passing(passes, lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Per row, the largest u32 key t in [lo, hi) with passes(t) (monotone: true up to some t, false
    after), given passes(lo) and not passes(hi): 32 halvings cover any u32 range."""
    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = passes(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[0]


def _kth_largest(keys: jax.Array, k: jax.Array) -> jax.Array:
    """u32[R] key of the k-th largest of keys u32[R, V] (1 <= k <= V): ties of it are kept too, as
    vLLM's top-k keeps every logit >= its k-th."""
    lo, hi = jnp.min(keys, -1), jnp.max(keys, -1)
    passes = lambda t: jnp.sum(keys >= t[:, None], -1) >= k
    return jnp.where(passes(hi), hi, _largest_passing(passes, lo, hi))


def _top_p_floor(weights: jax.Array, top_p: jax.Array) -> jax.Array:
    """u32[R] bits of the smallest weight kept by top-p over weights f32[R, V] >= 0: the largest t
    with mass(weights >= t) >= top_p x total, i.e. the smallest top set reaching top_p."""
    bits = jax.lax.bitcast_convert_type(weights, jnp.uint32)  # non-negative floats: bits keep the order
    goal = top_p * jnp.sum(weights, -1)
    passes = lambda t: jnp.sum(jnp.where(bits >= t[:, None], weights, 0.0), -1) >= goal
    return _largest_passing(passes, jnp.zeros_like(goal, jnp.uint32), jnp.max(bits, -1) + 1)


def inverse_cdf(weights: jax.Array, u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """i32[R] index drawn with probability weights / sum from f32[R, V] >= 0 and one uniform
    u f32[R] in [0, 1): the first index whose cumulative weight exceeds u x total, searched by
    blocks; and bool[R], the row had weight (a row of zero weights gives a garbage index, which
    the caller replaces)."""
    rows, vocab = weights.shape
    pad = -vocab % _BLOCK
    blocks = jnp.pad(weights, ((0, 0), (0, pad))).reshape(rows, -1, _BLOCK)  # [R, NB, 64]
    sums = jnp.sum(blocks, -1)  # [R, NB]
    cum = jnp.cumsum(sums, -1)
    target = u * cum[:, -1]
    # Rounding may put the target at or past the last cumulative sum: never leave the last block
    # (or token) that has weight.
    last = lambda w: w.shape[-1] - 1 - jnp.argmax(w[:, ::-1] > 0, -1)
    b = jnp.minimum(jnp.sum(cum <= target[:, None], -1), last(sums))
    before = jnp.where(b > 0, jnp.take_along_axis(cum, jnp.maximum(b - 1, 0)[:, None], -1)[:, 0], 0.0)
    chosen = jnp.take_along_axis(blocks, b[:, None, None], 1)[:, 0]  # [R, 64]
    inside = before[:, None] + jnp.cumsum(chosen, -1)
    j = jnp.minimum(jnp.sum(inside <= target[:, None], -1), last(chosen))
    return (b * _BLOCK + j).astype(jnp.int32), cum[:, -1] > 0  # (the total from the block sums: no pass of its own)


def _exclusive_prefix(w: jax.Array) -> jax.Array:
    """f32[R, K]: sum of w[:, :i] for each i, added left to right (so a row's sums do not depend on
    K: jnp.cumsum's association varies with the length)."""
    step = lambda acc, col: (acc + col, acc)
    return jax.lax.scan(step, jnp.zeros(w.shape[0], w.dtype), w.T)[1].T


def _candidates(scaled, top_k, top_p, min_p, keys, width):
    """Tokens i32[R] and whether any had weight, drawn among each row's top_k of `width` candidates."""
    values, ids = jax.lax.top_k(scaled, width)  # [R, K] best first, ties to the lower id
    # (the best as a max, not values[:, :1]: a second slice of top_k's result makes XLA:CPU
    # decompose top_k into a full sort of every row, 25x slower)
    e = jnp.exp(values - jnp.max(values, -1, keepdims=True))  # relative probabilities, 1 for the best
    keep = (jnp.arange(width) < top_k[:, None]) & (e >= min_p[:, None])
    w = jnp.where(keep, e, 0.0)
    before = _exclusive_prefix(w)
    total = before[:, -1] + w[:, -1]
    keep &= (before < (top_p * total)[:, None]) | (top_p >= 1.0)[:, None]
    u = jax.vmap(lambda key, row: jax.vmap(lambda t: jax.random.uniform(jax.random.fold_in(key, t)))(row))(keys, ids)
    score = jnp.where(keep, values - jnp.log(-jnp.log(u)), -jnp.inf)  # Gumbel-max
    pick = jnp.argmax(score, -1)
    return jnp.take_along_axis(ids, pick[:, None], -1)[:, 0], jnp.take_along_axis(score, pick[:, None], -1)[:, 0] > -jnp.inf


def _full_vocabulary(scaled, top_k, top_p, min_p, keys, elsewhere):
    """Tokens i32[R] and whether any had weight, drawn over the whole vocabulary: min_p, top-k
    above the candidate limit and top-p, each pass run only when some row drawing here asks for it
    (`lax.cond`; a pass leaves the rows that do not ask alone, so skipping it changes no token).
    `elsewhere` bool[R]: rows whose token comes from elsewhere (greedy, candidates)."""
    top = jnp.max(scaled, -1, keepdims=True)
    e = jnp.exp(scaled - jnp.where(jnp.isfinite(top), top, 0.0))  # [R, V] relative probabilities
    keep = e >= min_p[:, None]
    big_k = top_k > CANDIDATE_LIMIT

    def kth_largest(keep):
        kth = _kth_largest(_ordered(scaled), jnp.where(big_k, top_k, 1))
        return keep & ((_ordered(scaled) >= kth[:, None]) | ~big_k[:, None])

    keep = jax.lax.cond(jnp.any(big_k & ~elsewhere), kth_largest, lambda keep: keep, keep)
    weights = jnp.where(keep, e, 0.0)

    def top_p_pass(weights):
        floor = _top_p_floor(weights, top_p)
        bits = jax.lax.bitcast_convert_type(weights, jnp.uint32)
        return jnp.where((bits >= floor[:, None]) | (top_p >= 1.0)[:, None], weights, 0.0)

    weights = jax.lax.cond(jnp.any(~elsewhere & (top_p < 1.0)), top_p_pass, lambda weights: weights, weights)
    u = jax.vmap(jax.random.uniform)(keys)
    return inverse_cdf(weights, u)


def draw(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
         keys: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Samples i32[R] tokens from logits f32[R, V] (after the controls) under each row's
    temperature (> 0; other rows' results are garbage), top_k (0 = off, < V), top_p and min_p, with
    one key per row. Also returns bool[R]: the row had a token with weight (else all were masked).

    One program for every mix of settings: which paths run is decided at run time from the rows'
    own settings (`lax.cond` / `lax.switch`), never by a compiled variant, and a path leaves the
    rows that do not need it alone, so a row's token does not depend on what else its step asks."""
    rows, vocab = logits.shape
    random = temperature > 0

    def scaled():
        # Called inside each branch: XLA fuses the division into the branch's first pass instead of
        # writing an [R, V] array before the branches.
        return logits / jnp.where(random, temperature, 1.0)[:, None]

    small_k = random & (top_k > 0) & (top_k <= CANDIDATE_LIMIT)
    no_draw = (jnp.zeros(rows, jnp.int32), jnp.zeros(rows, bool))
    tokens, ok = jax.lax.cond(jnp.any(random & ~small_k),
                              lambda: _full_vocabulary(scaled(), top_k, top_p, min_p, keys, small_k | ~random),
                              lambda: no_draw)
    # Candidate rows: the step's largest such k picks the lax.top_k width, 16 or the limit
    # (top_k(16) costs about half of top_k(64) on XLA:CPU); the draw is the same at either width.
    widest = jnp.max(jnp.where(small_k, top_k, 0))
    branches = [lambda: no_draw] + [
        (lambda width: lambda: _candidates(scaled(), top_k, top_p, min_p, keys, width))(min(width, vocab))
        for width in CANDIDATE_WIDTHS]
    index = jnp.where(widest == 0, 0, jnp.where(widest <= CANDIDATE_WIDTHS[0], 1, 2))
    picked, picked_ok = jax.lax.switch(index, branches)
    return jnp.where(small_k, picked, tokens), jnp.where(small_k, picked_ok, ok)
