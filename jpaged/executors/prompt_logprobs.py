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
from jpaged.core.sequence import MAX_LOGPROBS
from jpaged.core.step_plan import PromptLogprobs, PromptRows
from jpaged.executors.sampling import normaliser


def padded_rows(rows: PromptRows) -> np.ndarray:
    """i32[P'] the rows' token rows padded to a bucket (padding reads token row 0 and is dropped)."""
    out = np.zeros(bucket(len(rows.token_rows)), np.int32)
    out[: len(rows.token_rows)] = rows.token_rows
    return out


@functools.partial(jax.jit, static_argnames=("offset", "num_top"))
def _prompt_logprobs(logits, targets, want_top, *, offset, num_top):
    sampled = logits[:offset]  # [S, V]: the sampling rows, for the sampler
    logits = logits[offset:].astype(jnp.float32)  # [P, V]: the prompt rows after the S sampling rows
    row_max, log_norm = normaliser(logits)  # [P, 1]: the sampler's arithmetic
    logprobs = (logits - row_max) - log_norm  # [P, V] (fused into the reductions below, never returned)
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)  # [P, 1]
    # vLLM's rank: how many tokens are at least as likely as the prompt's (itself included).
    ranks = jnp.sum(logprobs >= chosen, axis=-1, dtype=jnp.int32)  # [P]

    def top():
        top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)  # [P, K]
        return top_ids.astype(jnp.int32), top_logprobs

    none = lambda: (jnp.zeros((len(logits), num_top), jnp.int32), jnp.zeros((len(logits), num_top), jnp.float32))
    return sampled, chosen[:, 0], ranks, *jax.lax.cond(want_top, top, none)


def prompt_logprobs(logits: jax.Array, num_seqs: int, rows: PromptRows) -> tuple[PromptLogprobs, jax.Array]:
    """The log-probabilities at `rows` from the step's logits f32[S + P', vocab] (`num_seqs` = S,
    the padded sampling rows that come first; P' = the bucket of the rows), and the S sampling
    rows' logits [S, vocab] (sliced in the same program: no other compiles for them). The top
    candidates are computed at the most a request may ask (MAX_LOGPROBS), only when asked: one
    program per (S + P', S)."""
    count, k = len(rows.token_rows), rows.num_top
    targets = np.zeros(len(logits) - num_seqs, np.int32)
    targets[:count] = rows.targets
    num_top = min(MAX_LOGPROBS, logits.shape[-1])
    sampled, *result = _prompt_logprobs(logits, targets, np.bool_(k > 0), offset=num_seqs, num_top=num_top)
    chosen, ranks, top_ids, top_logprobs = jax.device_get(result)
    return PromptLogprobs(token_logprobs=chosen[:count], ranks=ranks[:count], top_ids=top_ids[:count, :k],
                          top_logprobs=top_logprobs[:count, :k]), sampled
