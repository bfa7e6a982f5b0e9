"""Next-token selection on device: greedy, the random draw, the sampling controls, top candidates.

The real executor's last stage: one jitted call per step samples every row of the plan's
SamplingBatch and brings back a few small arrays (no [S, vocab] transfer to the host). A step
with controls (penalties, logit_bias, banned or allowed tokens: jpaged.executors.logits_controls)
processes the logits first; greedy rows take the argmax, random rows draw
(jpaged.executors.draw: no vocabulary sort). Plain steps compile only the variants they always
did (all greedy, or with a random draw), never the controls'.
Randomness is a pure function of (seed, stream, position): the same request draws the same tokens
whatever else shares its batch and however often it was preempted. The stream separates the
sequences of one request (parallel sampling) and requests sharing a seed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.padding import bucket
from jpaged.core.step_plan import SamplingBatch
from jpaged.executors.draw import draw, draw_mode, row_keys
from jpaged.executors.logits_controls import apply_controls, padded_controls


@dataclasses.dataclass
class SampleResult:
    """Host arrays of one step's samples."""

    token_ids: np.ndarray  # i32[R] chosen tokens
    logprobs: np.ndarray  # f32[R] log-probability of each chosen token under the model
    top_ids: np.ndarray | None  # i32[R, num_top] most likely tokens, best first (beams, logprobs)
    top_logprobs: np.ndarray | None  # f32[R, num_top] their log-probabilities


def greedy_tokens(logits: jax.Array, row_max: jax.Array) -> jax.Array:
    """`jnp.argmax(logits, -1)` as i32[R] from logits f32[R, V] and their row max f32[R, 1]: the
    first index holding the max (or the first NaN, as argmax). A min over candidate indices is one
    plain reduction; argmax's (value, index) reduction ran at half the speed on XLA:CPU (48 x 50,272:
    7.1 -> 3.3 ms), and the max is needed for the log-probabilities anyway."""
    vocab = logits.shape[-1]
    is_max = (logits == row_max) | jnp.isnan(logits)  # a NaN row max is NaN: its first NaN wins
    return jnp.min(jnp.where(is_max, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def _greedy_and_logprobs(logits):
    """Greedy tokens i32[R] and their log-probabilities f32[R] from logits f32[R, V], plus the
    row max and log normaliser f32[R, 1] for the callers that need more log-probabilities.

    log_softmax's own arithmetic ((x - max) - log sum exp(x - max)), applied only to the entries
    returned: row reductions [R, V] -> [R], no [R, V] row of log-probabilities written.
    """
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # [R, 1]
    tokens = greedy_tokens(logits, row_max)
    log_norm = jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))  # [R, 1]
    return tokens, _logprob_of(logits, tokens, row_max, log_norm), row_max, log_norm


def _logprob_of(logits, tokens, row_max, log_norm):
    return ((jnp.take_along_axis(logits, tokens[:, None], axis=-1) - row_max) - log_norm)[:, 0]


@functools.partial(jax.jit, static_argnames=("num_top", "mode"))
def _sample(logits, logits_rows, temperature, top_k, top_p, min_p, seed, stream, position, controls, *,
            num_top, mode):
    logits = logits.astype(jnp.float32)  # [S, V]
    if mode is None and not num_top and controls is None:
        # All greedy: reduce the step's rows where they lie and pick the results per sample row,
        # rather than first copying every sample row's [V] logits (the same arithmetic per row).
        tokens, chosen, _, _ = _greedy_and_logprobs(logits)
        return tokens[logits_rows], chosen[logits_rows], None, None
    logits = logits[logits_rows]  # [R, V]
    # Log-probabilities are the model's raw ones (vLLM's raw_logprobs): before controls and temperature.
    tokens, chosen, row_max, log_norm = _greedy_and_logprobs(logits)
    processed = logits
    if controls is not None:
        processed = apply_controls(logits, controls)
        tokens = greedy_tokens(processed, jnp.max(processed, axis=-1, keepdims=True))  # greedy: their argmax
    if mode is not None:
        drawn, ok = draw(processed, temperature, top_k, top_p, min_p, row_keys(seed, stream, position), mode)
        tokens = jnp.where((temperature > 0) & ok, drawn, tokens)  # (every token masked: the argmax)
    if mode is not None or controls is not None:
        chosen = _logprob_of(logits, tokens, row_max, log_norm)
    if num_top:
        top_logits, top_ids = jax.lax.top_k(logits, num_top)  # log-softmax keeps the order
        return tokens, chosen, top_ids.astype(jnp.int32), (top_logits - row_max) - log_norm
    return tokens, chosen, None, None


def sample(logits: jax.Array, batch: SamplingBatch) -> SampleResult:
    """Samples every row of `batch` from `logits` f32[S, vocab]; rows are padded to a bucket."""
    rows = len(batch.logits_rows)
    size = bucket(rows)
    vocab = logits.shape[-1]

    def pad(a, dtype):
        out = np.zeros(size, dtype)
        out[:rows] = a
        return out

    k = batch.num_top
    # Candidates per row rounded up to a bucket (within the vocabulary): a few compiled variants.
    num_top = min(bucket(k, minimum=1), vocab) if k else 0
    top_k = np.where(batch.top_k >= vocab, 0, batch.top_k)  # k >= V keeps every token
    mode = draw_mode(batch.temperature, top_k, batch.top_p)
    if mode is not None and mode.num_candidates > vocab:
        mode = mode._replace(num_candidates=vocab)
    controls = None if batch.controls is None else padded_controls(batch.controls, size, vocab)
    out = _sample(logits, pad(batch.logits_rows, np.int32), pad(batch.temperature, np.float32),
                  pad(top_k, np.int32), pad(batch.top_p, np.float32) + (np.arange(size) >= rows),
                  np.zeros(size, np.float32) if batch.min_p is None else pad(batch.min_p, np.float32),
                  pad(batch.seed, np.uint32), pad(batch.stream, np.int32), pad(batch.position, np.int32), controls,
                  num_top=num_top, mode=mode)
    tokens, chosen, top_ids, top_logprobs = jax.device_get(out)
    return SampleResult(tokens[:rows], chosen[:rows],
                        None if top_ids is None else top_ids[:rows, :k],
                        None if top_logprobs is None else top_logprobs[:rows, :k])
