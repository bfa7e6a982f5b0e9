"""Log-probability arithmetic shared by the sampler and the model step's prompt scores.

`normaliser` is log_softmax's own arithmetic split in two, so that only the entries a caller keeps
are ever formed: every log-probability jpaged returns, sampled or of a prompt, comes from it, and
the same logits row gives the same bits in either program. `prompt_scores` reduces a step's logits
at every token row to what vLLM reports per prompt position (jpaged.executors.prompt_logprobs):
the prompt token's log-probability, its rank, and the top candidates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def normaliser(logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Row max and log normaliser f32[S, 1] of logits f32[S, V]: log_softmax's own arithmetic
    ((x - max) - log sum exp(x - max)) is then applied only to the entries returned, with no
    [S, V] row of log-probabilities written."""
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # [S, 1]
    return row_max, jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))


def prompt_scores(logits: jax.Array, targets: jax.Array, want_top: jax.Array, num_top: int
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """For logits f32[T, V] and the token each row predicts, targets i32[T]: (log-probability of
    the target f32[T], its rank i32[T] (vLLM's: how many tokens are at least as likely, itself
    included), the `num_top` most likely ids i32[T, K] and their log-probabilities f32[T, K]).
    The top candidates are computed only when `want_top` (bool[]), else zeros."""
    row_max, log_norm = normaliser(logits)  # [T, 1]
    logprobs = (logits - row_max) - log_norm  # [T, V] (fused into the reductions below, never returned)
    chosen = jnp.take_along_axis(logprobs, targets[:, None], axis=-1)  # [T, 1]
    ranks = jnp.sum(logprobs >= chosen, axis=-1, dtype=jnp.int32)  # [T]

    def top():
        top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)  # [T, K]
        return top_ids.astype(jnp.int32), top_logprobs

    def none():
        return jnp.zeros((len(logits), num_top), jnp.int32), jnp.zeros((len(logits), num_top), jnp.float32)

    return chosen[:, 0], ranks, *jax.lax.cond(want_top, top, none)
