"""Prompt log-probabilities on device (SamplingParams.prompt_logprobs).

A step with a prompt chunk and PromptRows runs the model step's prompt variant: logits at every
token row, after the S sampling rows ([S + T, vocab]), with S padded to the widest S of the step's
T (`prompt_step_seqs`), so the variant is one program per padded token count T. A decode-shaped
step (one token per sequence) needs no variant: each of its token rows is a sequence's logits row.
One jitted call then turns the rows into what vLLM reports per prompt position: the
log-probability of the prompt's own next token, its rank, and the top k tokens with theirs. Only
those small arrays come back to the host, never a [P, vocab] row of log-probabilities.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.sequence import MAX_LOGPROBS
from jpaged.core.step_plan import PromptLogprobs, StepPlan
from jpaged.executors.sampling import normaliser


class PromptLogprobsProgram(NamedTuple):
    """The prompt log-probabilities' compiled program for one logits shape."""

    num_logits_rows: int  # N: the step's logits rows, [S + T] (prompt variant) or [S] (decode)
    num_prompt_rows: int  # P: the rows read: the T token rows (prompt variant) or the S sequences (decode)
    num_sampled: int  # S rows sliced off for the sampler (prompt variant), or 0 (decode: the logits as they are)


def prompt_step_seqs(prefill_shapes: list[tuple[int, int, int]]) -> dict[int, int]:
    """T -> the widest S of the (T, S, M) step shapes `prefill_shapes`: a step with prompt rows is
    padded to it, so its prompt variant compiles once per T."""
    widest: dict[int, int] = {}
    for num_tokens, num_seqs, _ in prefill_shapes:
        widest[num_tokens] = max(num_seqs, widest.get(num_tokens, 0))
    return widest


def with_seqs(plan: StepPlan, num_seqs: int) -> StepPlan:
    """`plan` with its per-sequence arrays padded to `num_seqs` rows: padding sequences have no
    context, an empty query range, a table of block 0 and logits row 0 (read by no sample)."""
    extra = num_seqs - len(plan.context_lens)
    if extra <= 0:
        return plan
    qsl = plan.query_start_loc
    return dataclasses.replace(
        plan, query_start_loc=np.concatenate([qsl, np.full(extra, qsl[-1], np.int32)]),
        context_lens=np.concatenate([plan.context_lens, np.zeros(extra, np.int32)]),
        block_tables=np.concatenate([plan.block_tables, np.zeros((extra, plan.block_tables.shape[1]), np.int32)]),
        logits_indices=np.concatenate([plan.logits_indices, np.zeros(extra, np.int32)]))


@functools.partial(jax.jit, static_argnames=("num_sampled", "num_top"))
def _prompt_logprobs(logits, rows, targets, want_top, *, num_sampled, num_top):
    sampled = logits[:num_sampled] if num_sampled else None  # [S, V]: the sampling rows, for the sampler
    logits = logits[rows].astype(jnp.float32)  # [P, V]
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


def program_of(plan: StepPlan, num_logits_rows: int) -> PromptLogprobsProgram:
    """The program that reads `plan`'s prompt rows from its step's logits of `num_logits_rows` rows."""
    if plan.max_query_len <= 1:
        return PromptLogprobsProgram(num_logits_rows, num_logits_rows, 0)
    num_tokens = len(plan.token_ids)
    return PromptLogprobsProgram(num_logits_rows, num_tokens, num_logits_rows - num_tokens)


def prompt_logprobs(logits: jax.Array, plan: StepPlan) -> tuple[PromptLogprobs, jax.Array]:
    """The log-probabilities at `plan.prompt_rows` from its step's logits f32[S + T, vocab] (the
    prompt variant) or f32[S, vocab] (a decode-shaped plan), and the S sampling rows' logits
    [S, vocab] (sliced in the same program). The top candidates are computed at the most a request
    may ask (MAX_LOGPROBS), only when asked: one program per `PromptLogprobsProgram`."""
    rows = plan.prompt_rows
    program = program_of(plan, len(logits))
    count, k = len(rows.token_rows), rows.num_top
    read = np.zeros(program.num_prompt_rows, np.int32)  # the logits row of each prompt row
    if program.num_sampled:
        read[:count] = program.num_sampled + rows.token_rows  # token row t's logits follow the S rows
    else:
        # One token per sequence: token row t is the logits row of the sequence that computes it.
        logits_row = np.zeros(len(plan.token_ids), np.int32)
        logits_row[plan.logits_indices[: plan.num_seqs]] = np.arange(plan.num_seqs, dtype=np.int32)
        read[:count] = logits_row[rows.token_rows]
    targets = np.zeros(program.num_prompt_rows, np.int32)
    targets[:count] = rows.targets
    num_top = min(MAX_LOGPROBS, logits.shape[-1])
    sampled, *result = _prompt_logprobs(logits, read, targets, np.bool_(k > 0), num_sampled=program.num_sampled,
                                        num_top=num_top)
    chosen, ranks, top_ids, top_logprobs = jax.device_get(result)
    return PromptLogprobs(token_logprobs=chosen[:count], ranks=ranks[:count], top_ids=top_ids[:count, :k],
                          top_logprobs=top_logprobs[:count, :k]), logits if sampled is None else sampled
