"""Prompt log-probabilities (SamplingParams.prompt_logprobs): a plan's PromptRows in, vLLM's
per-position report out.

A step with prompt rows runs the model step's one program with its prompt scores on
(`ModelRunner.step_with_prompt_scores`): behind a `lax.cond` the LM head also runs at every token
row, and each row is reduced on device to the log-probability of the token it predicts, its rank
and the top candidates (jpaged.models.logprobs.prompt_scores, the sampler's arithmetic), so no
[T, vocab] row of log-probabilities comes back to the host and no program compiles for it. Here:
the targets the step scores, and the rows the plan asked for picked from the result.
"""

from __future__ import annotations

import jax
import numpy as np

from jpaged.core.step_plan import PromptLogprobs, PromptRows
from jpaged.models.runner import PromptScores


def targets(rows: PromptRows, num_tokens: int) -> np.ndarray:
    """i32[T]: at each of the plan's prompt rows the prompt token it predicts, 0 at the others
    (scored too, read by nobody)."""
    out = np.zeros(num_tokens, np.int32)
    out[rows.token_rows] = rows.targets
    return out


def picked(scores: PromptScores, rows: PromptRows) -> PromptLogprobs:
    """The plan's prompt rows out of a step's prompt scores (on device; fetched here), the top
    candidates cut to the most any of its requests asked for."""
    chosen, ranks, top_ids, top_logprobs = jax.device_get(scores)
    at, k = rows.token_rows, rows.num_top
    return PromptLogprobs(token_logprobs=chosen[at], ranks=ranks[at], top_ids=top_ids[at, :k],
                          top_logprobs=top_logprobs[at, :k])
