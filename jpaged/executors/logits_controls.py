"""The device half of the sampling controls: vLLM's logits processors and penalties on [R, V] logits.

In vLLM v1's order (vllm/v1/sample/sampler.py): allowed tokens, banned tokens (bad words, and
min_tokens' stop ids), logit_bias, then the penalties (repetition over prompt and output tokens,
frequency and presence over output tokens). Each row reads only its own entries of the compact
arrays the host built (jpaged.core.sampling_controls); padding ids fall outside the vocabulary and
are dropped by the scatters, so a row's result does not depend on the widths.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.constraints import bitmask_words
from jpaged.core.padding import control_width
from jpaged.core.sampling_controls import PAD_ID, SamplingControls


class DeviceControls(NamedTuple):
    """SamplingControls padded to the step's R rows and their lists to `control_width` (None fields: no row uses them; jit compiles
    each combination of present fields once per shape)."""

    penalties: np.ndarray | None  # f32[R, 3] presence, frequency, repetition
    history: np.ndarray | None  # i32[R, L] tokens the penalties see
    output_start: np.ndarray | None  # i32[R] first output token's index in history
    bias_ids: np.ndarray | None  # i32[R, B]
    bias_values: np.ndarray | None  # f32[R, B]
    banned: np.ndarray | None  # i32[R, N]
    allowed: np.ndarray | None  # i32[R, ceil(V / 32)] allowed-token bits (-1: every token)


def padded_controls(controls: SamplingControls, size: int, vocab: int) -> DeviceControls:
    """`controls` of R rows as DeviceControls of `size` >= R rows over a vocabulary of `vocab`:
    padding rows neutral, allowed masks widened to the vocabulary's words (unrestricted rows all
    ones; a restricted row allows nothing past its own mask)."""
    def rows(a, fill, widen=False):
        if a is None:
            return None
        # Id lists widened to the `control_width` ladder: fewer compiled widths, the same result.
        width = (control_width(a.shape[1]),) if widen else a.shape[1:]
        out = np.full((size, *width), fill, a.dtype)
        if widen:
            out[: len(a), : a.shape[1]] = a
        else:
            out[: len(a)] = a
        return out

    allowed = None
    if controls.allowed_masks is not None:
        words = bitmask_words(vocab)
        masks = controls.allowed_masks
        if masks.shape[1] > words and masks[:, words:].any():
            raise ValueError(f"allowed token masks reach past the vocabulary of {vocab} tokens")
        allowed = np.full((size, words), -1, np.int32)
        allowed[controls.allowed_rows] = 0
        width = min(words, masks.shape[1])
        allowed[controls.allowed_rows, :width] = masks[:, :width]
    penalties = rows(controls.penalties, 0.0)
    if penalties is not None:
        penalties[len(controls.penalties):, 2] = 1.0
    return DeviceControls(penalties=penalties, history=rows(controls.history, PAD_ID, widen=True),
                          output_start=rows(controls.output_start, 0),
                          bias_ids=rows(controls.bias_ids, PAD_ID, widen=True),
                          bias_values=rows(controls.bias_values, 0.0, widen=True),
                          banned=rows(controls.banned, PAD_ID, widen=True),
                          allowed=allowed)


def apply_controls(logits: jax.Array, c: DeviceControls) -> jax.Array:
    """The processed logits f32[R, V]: masks, bias and penalties of every row (neutral rows exact)."""
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]
    if c.allowed is not None:
        bits = (c.allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
        logits = jnp.where(bits.reshape(num_rows, -1)[:, :vocab] == 1, logits, -jnp.inf)
    if c.banned is not None:
        logits = logits.at[rows, c.banned].set(-jnp.inf, mode="drop")
    if c.bias_ids is not None:
        logits = logits.at[rows, c.bias_ids].add(c.bias_values, mode="drop")
    if c.penalties is not None:
        seen = jnp.zeros((num_rows, vocab), bool).at[rows, c.history].set(True, mode="drop")  # prompt or output
        in_output = (jnp.arange(c.history.shape[1]) >= c.output_start[:, None]).astype(jnp.int32)
        counts = jnp.zeros((num_rows, vocab), jnp.int32).at[rows, c.history].add(in_output, mode="drop")
        presence, frequency, repetition = (c.penalties[:, i: i + 1] for i in range(3))
        # vLLM's arithmetic: multiply by 1 / penalty (not divide) where the logit is positive.
        penalty = jnp.where(seen, repetition, 1.0)
        logits = logits * jnp.where(logits > 0, 1.0 / penalty, penalty)
        logits = logits - frequency * counts.astype(jnp.float32)
        logits = logits - presence * (counts > 0).astype(jnp.float32)
    return logits
