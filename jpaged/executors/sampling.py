"""Next-token selection on device: greedy, the random draw, the sampling controls, top candidates.

The real executor's last stage: a step's SamplingBatch is sampled by up to three jitted calls that
bring back a few small arrays (no [S, vocab] transfer to the host), each with its own few static
variants so that the variants add up instead of multiplying (jpaged.executors.warmup compiles the
common ones before serving):

- controls (`ControlsVariant`, only a step with penalties, logit_bias, banned or allowed tokens:
  jpaged.executors.logits_controls): the processed logits of the sample rows;
- the choice (`DrawVariant`): greedy rows take the argmax (of the processed logits when there are
  any), random rows draw (jpaged.executors.draw: no vocabulary sort); the chosen token's
  log-probability is the model's raw one;
- top candidates (`TopVariant`, only a step asking for them: beams, logprobs).

Sample rows are padded to the step's S (at most S rows a call), so a step's shape fixes the
sampler's. Randomness is a pure function of (seed, stream, position): the same request draws the
same tokens whatever else shares its batch and however often it was preempted. The stream
separates the sequences of one request (parallel sampling) and requests sharing a seed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.padding import bucket
from jpaged.core.sampling_controls import SamplingControls
from jpaged.core.step_plan import SamplingBatch
from jpaged.executors.draw import CANDIDATE_LIMIT, DrawMode, draw, draw_mode, row_keys
from jpaged.executors.logits_controls import DeviceControls, apply_controls, padded_controls


class DrawVariant(NamedTuple):
    """The static shape of the choosing call: a compiled program each."""

    num_rows: int  # S: sample rows are padded to it
    mode: DrawMode | None  # the random draw's shape (None: every row greedy)
    controlled: bool  # the rows' logits were processed by the controls first


class TopVariant(NamedTuple):
    """The static shape of the top-candidates call."""

    num_rows: int  # S
    num_top: int  # `top_width` of the candidates asked


class ControlsVariant(NamedTuple):
    """The static shape of the controls call: which controls the step has and their list widths."""

    num_rows: int  # S
    history: int  # L of the penalties' token lists (0: no penalties)
    bias: int  # B of the logit_bias lists (0: none)
    banned: int  # N of the banned-id lists (0: none)
    allowed: bool  # some row is restricted to a set of tokens


SamplerProgram = DrawVariant | TopVariant | ControlsVariant


@dataclasses.dataclass
class SampleResult:
    """Host arrays of one step's samples."""

    token_ids: np.ndarray  # i32[R] chosen tokens
    logprobs: np.ndarray  # f32[R] log-probability of each chosen token under the model
    top_ids: np.ndarray | None  # i32[R, num_top] most likely tokens, best first (beams, logprobs)
    top_logprobs: np.ndarray | None  # f32[R, num_top] their log-probabilities


def top_width(k: int, vocab: int) -> int:
    """The compiled number of top candidates for `k` requested (0: none): 8, 32, 128, ... (x4), at
    most the vocabulary. lax.top_k returns the same first k of any wider top (ties to the lower id),
    so a coarse ladder changes no result and keeps the variants few."""
    if not k:
        return 0
    width = 8
    while width < k:
        width *= 4
    return min(width, vocab)


def greedy_tokens(logits: jax.Array, row_max: jax.Array) -> jax.Array:
    """`jnp.argmax(logits, -1)` as i32[R] from logits f32[R, V] and their row max f32[R, 1]: the
    first index holding the max (or the first NaN, as argmax). A min over candidate indices is one
    plain reduction; argmax's (value, index) reduction ran at half the speed on XLA:CPU (48 x 50,272:
    7.1 -> 3.3 ms), and the max is needed for the log-probabilities anyway."""
    vocab = logits.shape[-1]
    is_max = (logits == row_max) | jnp.isnan(logits)  # a NaN row max is NaN: its first NaN wins
    return jnp.min(jnp.where(is_max, jnp.arange(vocab, dtype=jnp.int32), vocab), axis=-1)


def _normaliser(logits):
    """Row max and log normaliser f32[R, 1] of logits f32[R, V]: log_softmax's own arithmetic
    ((x - max) - log sum exp(x - max)) is then applied only to the entries returned, with no
    [R, V] row of log-probabilities written."""
    row_max = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))  # [R, 1]
    return row_max, jnp.log(jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True))


def _logprob_of(logits, tokens, row_max, log_norm):
    return ((jnp.take_along_axis(logits, tokens[:, None], axis=-1) - row_max) - log_norm)[:, 0]


@jax.jit
def _controls(logits, logits_rows, controls: DeviceControls):
    """The sample rows' logits f32[R, V] after the controls (R = len(logits_rows))."""
    return apply_controls(logits.astype(jnp.float32)[logits_rows], controls)


@functools.partial(jax.jit, static_argnames=("mode",))
def _choose(logits, logits_rows, processed, temperature, top_k, top_p, min_p, seed, stream, position, *, mode):
    """Tokens i32[R] and their raw log-probabilities f32[R]; `processed` f32[R, V] or None."""
    logits = logits.astype(jnp.float32)  # [S, V]
    if mode is None and processed is None:
        # All greedy: reduce the step's rows where they lie and pick the results per sample row,
        # rather than first copying every sample row's [V] logits (the same arithmetic per row).
        row_max, log_norm = _normaliser(logits)
        tokens = greedy_tokens(logits, row_max)
        return tokens[logits_rows], _logprob_of(logits, tokens, row_max, log_norm)[logits_rows]
    logits = logits[logits_rows]  # [R, V]
    # Log-probabilities are the model's raw ones (vLLM's raw_logprobs): before controls and temperature.
    row_max, log_norm = _normaliser(logits)
    chosen_from = logits if processed is None else processed
    tokens = greedy_tokens(chosen_from, jnp.max(chosen_from, axis=-1, keepdims=True))
    if mode is not None:
        drawn, ok = draw(chosen_from, temperature, top_k, top_p, min_p, row_keys(seed, stream, position), mode)
        tokens = jnp.where((temperature > 0) & ok, drawn, tokens)  # (every token masked: the argmax)
    return tokens, _logprob_of(logits, tokens, row_max, log_norm)


@functools.partial(jax.jit, static_argnames=("num_top",))
def _top(logits, logits_rows, *, num_top):
    """The `num_top` most likely tokens i32[R, num_top] of each sample row, best first, and their
    raw log-probabilities f32[R, num_top]."""
    logits = logits.astype(jnp.float32)[logits_rows]  # [R, V]
    row_max, log_norm = _normaliser(logits)
    top_logits, top_ids = jax.lax.top_k(logits, num_top)  # log-softmax keeps the order
    return top_ids.astype(jnp.int32), (top_logits - row_max) - log_norm


def _draw_settings(batch: SamplingBatch, vocab: int) -> tuple[np.ndarray, DrawMode | None]:
    """The rows' top_k as the draw reads it (k >= V keeps every token: 0) and the step's DrawMode."""
    top_k = np.where(batch.top_k >= vocab, 0, batch.top_k)
    mode = draw_mode(batch.temperature, top_k, batch.top_p)
    if mode is not None and mode.full_top_k:
        # A top_k above the candidate limit is rare: its steps run the widest mode, which draws the
        # same tokens (each path leaves the rows that do not need it alone, and the candidates'
        # draw does not depend on the width), so 5 of draw_mode's 13 variants are never compiled.
        mode = DrawMode(num_candidates=CANDIDATE_LIMIT, full_top_k=True, full_top_p=True)
    if mode is not None and mode.num_candidates > vocab:
        mode = mode._replace(num_candidates=vocab)
    return top_k, mode


def _controls_variant(controls: DeviceControls, num_rows: int) -> ControlsVariant:
    width = lambda a: 0 if a is None else a.shape[1]  # (a step's controls may all be None: a neutral call)
    return ControlsVariant(num_rows, width(controls.history), width(controls.bias_ids), width(controls.banned),
                           controls.allowed is not None)


_ROW_FIELDS = ("logits_rows", "temperature", "top_k", "top_p", "seed", "stream", "position", "min_p")


def _control_rows(controls: SamplingControls, start: int, stop: int) -> SamplingControls | None:
    """Rows [start, stop) of `controls` (None: those rows have none)."""
    part = {f.name: None if getattr(controls, f.name) is None else getattr(controls, f.name)[start:stop]
            for f in dataclasses.fields(SamplingControls) if not f.name.startswith("allowed")}
    if controls.allowed_rows is not None:
        inside = (controls.allowed_rows >= start) & (controls.allowed_rows < stop)
        if inside.any():
            part["allowed_rows"] = controls.allowed_rows[inside] - start
            part["allowed_masks"] = controls.allowed_masks[inside]
    return SamplingControls(**part) if any(v is not None for v in part.values()) else None


def split_rows(batch: SamplingBatch, size: int) -> list[SamplingBatch]:
    """`batch` as consecutive batches of at most `size` rows (each row's draw depends on its own
    settings alone, so splitting changes no token)."""
    rows = len(batch.logits_rows)
    if rows <= size:
        return [batch]
    return [dataclasses.replace(
        batch, controls=None if batch.controls is None else _control_rows(batch.controls, i, i + size),
        **{f: None if getattr(batch, f) is None else getattr(batch, f)[i: i + size] for f in _ROW_FIELDS})
        for i in range(0, rows, size)]


def programs_of(batch: SamplingBatch, num_rows: int, vocab: int) -> list[SamplerProgram]:
    """The sampler programs that sample `batch` (at most `num_rows` rows) from logits [num_rows, vocab]."""
    programs: list[SamplerProgram] = []
    if batch.controls is not None:
        programs.append(_controls_variant(padded_controls(batch.controls, num_rows, vocab), num_rows))
    programs.append(DrawVariant(num_rows, _draw_settings(batch, vocab)[1], batch.controls is not None))
    if batch.num_top:
        programs.append(TopVariant(num_rows, top_width(batch.num_top, vocab)))
    return programs


def sample(logits: jax.Array, batch: SamplingBatch) -> SampleResult:
    """Samples every row of `batch` from `logits` f32[S, vocab]. Up to S rows are padded to S, so a
    step's shape fixes the sampler's programs (`programs_of`); more rows are padded to a power of
    two, programs of their own (the executor splits them into calls of S rows instead)."""
    rows, (size, vocab) = len(batch.logits_rows), logits.shape
    size = size if rows <= size else bucket(rows)

    def pad(a, dtype):
        out = np.zeros(size, dtype)
        out[:rows] = a
        return out

    logits_rows = pad(batch.logits_rows, np.int32)
    top_k, mode = _draw_settings(batch, vocab)
    processed = None
    if batch.controls is not None:
        processed = _controls(logits, logits_rows, padded_controls(batch.controls, size, vocab))
    out = _choose(logits, logits_rows, processed, pad(batch.temperature, np.float32), pad(top_k, np.int32),
                  pad(batch.top_p, np.float32) + (np.arange(size) >= rows),
                  np.zeros(size, np.float32) if batch.min_p is None else pad(batch.min_p, np.float32),
                  pad(batch.seed, np.uint32), pad(batch.stream, np.int32), pad(batch.position, np.int32), mode=mode)
    k = batch.num_top
    top = (None, None) if not k else _top(logits, logits_rows, num_top=top_width(k, vocab))
    tokens, chosen, top_ids, top_logprobs = jax.device_get((*out, *top))
    return SampleResult(tokens[:rows], chosen[:rows],
                        None if top_ids is None else top_ids[:rows, :k],
                        None if top_logprobs is None else top_logprobs[:rows, :k])
