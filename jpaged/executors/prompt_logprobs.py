"""Prompt log-probabilities on device (SamplingParams.prompt_logprobs).

The model step returns logits at the plan's PromptRows after its S sampling rows (ModelRunner's
`prompt_rows`); here one jitted call turns them into what vLLM reports per prompt position: the
log-probability of the prompt's own next token, its rank, and the top k tokens with theirs. Only
those small arrays come back to the host, never a [P, vocab] row of log-probabilities.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.padding import bucket
from jpaged.core.step_plan import PromptLogprobs, PromptRows


def padded_rows(rows: PromptRows) -> np.ndarray:
    """i32[P'] the rows' token rows padded to a bucket (padding reads token row 0 and is dropped)."""
    out = np.zeros(bucket(len(rows.token_rows)), np.int32)
    out[: len(rows.token_rows)] = rows.token_rows
    return out


@functools.partial(jax.jit, static_argnames=("offset", "num_top"))
def _prompt_logprobs(logits, targets, *, offset, num_top):
    logits = logits[offset:].astype(jnp.float32)  # [P, V]: the prompt rows after the S sampling rows
    # log_softmax's arithmetic ((x - max) - log sum exp(x - max)), as the sampler computes it.
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # [P, 1]
    log_norm = jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))  # [P, 1]
    logprobs = (logits - row_max) - log_norm  # [P, V] (fused into the reductions below, never returned)
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)  # [P, 1]
    # vLLM's rank: how many tokens are at least as likely as the prompt's (itself included).
    ranks = jnp.sum(logprobs >= chosen, axis=-1, dtype=jnp.int32)  # [P]
    if not num_top:
        return chosen[:, 0], ranks, None, None
    top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)  # [P, K]
    return chosen[:, 0], ranks, top_ids.astype(jnp.int32), top_logprobs


def prompt_logprobs(logits: jax.Array, num_seqs: int, rows: PromptRows) -> PromptLogprobs:
    """The log-probabilities at `rows` from the step's logits f32[S + P', vocab] (`num_seqs` = S,
    the padded sampling rows that come first; P' = the bucket of the rows)."""
    count, k = len(rows.token_rows), rows.num_top
    targets = np.zeros(len(logits) - num_seqs, np.int32)
    targets[:count] = rows.targets
    # Top candidates rounded up to a bucket (within the vocabulary): a few compiled variants.
    num_top = min(bucket(k, minimum=1), logits.shape[-1]) if k else 0
    chosen, ranks, top_ids, top_logprobs = jax.device_get(
        _prompt_logprobs(logits, targets, offset=num_seqs, num_top=num_top))
    if top_ids is None:
        top_ids, top_logprobs = np.zeros((count, 0), np.int32), np.zeros((count, 0), np.float32)
    return PromptLogprobs(token_logprobs=chosen[:count], ranks=ranks[:count], top_ids=top_ids[:count, :k],
                          top_logprobs=top_logprobs[:count, :k])
