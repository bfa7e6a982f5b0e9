"""Next-token selection on device: greedy, the random draw, the sampling controls, top candidates.

The real executor's last stage: a step's SamplingBatch is sampled by ONE jitted call that brings
back a few small arrays (no [S, vocab] transfer to the host). Every mode and control is per-row
data of a fixed shape (`SamplerRows`: temperature, top_k, top_p, min_p, seeds; the controls'
id lists at fixed widths and allowed-token bitmasks, jpaged.executors.logits_controls; a
top-candidate count up to the most any request may ask), and the work a step does not need is
skipped at run time (`lax.cond` / `lax.switch` on "some row asks for it"), so the sampler
compiles one program per padded row count (`SamplerProgram`), whatever its requests ask:

- the choice: greedy rows take the argmax (of the processed logits when some row has controls),
  random rows draw (jpaged.executors.draw: no vocabulary sort); a step of greedy rows without
  controls reduces the logits where they lie and skips the rest;
- log-probabilities are the model's raw ones, every one of them (chosen tokens', top
  candidates') from one normaliser per logits row computed before any branch: the same bits
  whatever else the step asks;
- top candidates (beams, logprobs): `lax.top_k` at the step's width of the ladder `top_width`.

Sample rows are padded to the step's S (at most S rows a call), so a step's shape fixes the
sampler's. Randomness is a pure function of (seed, stream, position): the same request draws the
same tokens whatever else shares its batch and however often it was preempted. The stream
separates the sequences of one request (parallel sampling) and requests sharing a seed.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.padding import bucket, padded_sizes
from jpaged.core.sampling_controls import SamplingControls, history_width
from jpaged.core.sequence import MAX_BANNED_IDS, MAX_LOGIT_BIAS_IDS, MAX_LOGPROBS
from jpaged.core.step_plan import SamplingBatch
from jpaged.executors.draw import draw, row_keys
from jpaged.executors.logits_controls import ControlWidths, DeviceControls, any_control, apply_controls, padded_controls
from jpaged.models.executable_store import StoredJit
from jpaged.models.logprobs import normaliser


class SamplerProgram(NamedTuple):
    """The sampler's one compiled program for steps of `num_rows` padded sample rows."""

    num_rows: int  # S: sample rows are padded to it


class SamplerWidths(NamedTuple):
    """The fixed widths of the sampler's per-row data under an engine's limits."""

    controls: ControlWidths
    num_top: int  # K: most top candidates a step may ask (logprobs, beams), on the `top_width` ladder


def sampler_widths(max_model_len: int, max_num_seqs: int, vocab: int) -> SamplerWidths:
    """The widths for an engine of `max_model_len` tokens per request and `max_num_seqs` sequences
    per step (beams rank 2 x their width) over a vocabulary of `vocab`."""
    return SamplerWidths(ControlWidths(history=history_width(max_model_len), bias=MAX_LOGIT_BIAS_IDS,
                                       banned=MAX_BANNED_IDS),
                         top_width(min(max(MAX_LOGPROBS, 2 * max_num_seqs), vocab), vocab))


def _fitting_widths(batch: SamplingBatch, vocab: int) -> SamplerWidths:
    """The narrowest widths that hold `batch` (a call without an engine's limits: tests, benchmarks)."""
    c = batch.controls

    def width(name: str, least: int) -> int:
        a = None if c is None else getattr(c, name)
        return least if a is None else max(least, a.shape[1])

    return SamplerWidths(ControlWidths(width("history", 64), width("bias_ids", 8), width("banned", 8)),
                         top_width(max(batch.num_top, 1), vocab))


class SamplerRows(NamedTuple):
    """One step's sample rows as the sampler's device inputs, padded to R rows."""

    logits_rows: np.ndarray  # i32[R] the logits row each sample reads
    temperature: np.ndarray  # f32[R] 0 = greedy, -1 on padding rows
    top_k: np.ndarray  # i32[R] 0 = off (k >= V is off too)
    top_p: np.ndarray  # f32[R] 1 = off (padding rows: 1)
    min_p: np.ndarray  # f32[R] 0 = off
    seed: np.ndarray  # u32[R]
    stream: np.ndarray  # i32[R]
    position: np.ndarray  # i32[R]
    top_branch: np.ndarray  # i32[] the top-candidate width's index in `top_ladder` (0: none)
    controls: DeviceControls


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
    so a coarse ladder changes no result and keeps the branches few."""
    if not k:
        return 0
    width = 8
    while width < k:
        width *= 4
    return min(width, vocab)


def top_ladder(num_top: int, vocab: int) -> list[int]:
    """The top-candidate widths of the sampler's branches up to `num_top`: 0 (none), 8, 32, ..."""
    return [0] + [width for _, width in padded_sizes(lambda k: top_width(k, vocab), 1, num_top)]


def argmax_block(vocab: int) -> int:
    """Tokens per block of `greedy_tokens`' first pass: the largest divisor of `vocab` up to 128
    (so that the rows reshape into blocks without a copy); below 16 the blocks would be too many to
    pay, and `greedy_tokens` takes jnp.argmax instead."""
    return max(b for b in range(1, 129) if vocab % b == 0)


def greedy_tokens(logits: jax.Array, maybe_nan: jax.Array) -> jax.Array:
    """`jnp.argmax(logits, -1)` as i32[R] from logits f32[R, V]: the first index holding the row's
    max, or its first NaN. `maybe_nan` (bool[]): some row may hold a NaN, which XLA:CPU's
    vectorised max skips; those steps take jnp.argmax itself. Otherwise the max of each block of
    `argmax_block(V)` tokens (one plain reduction), the first block reaching the row's max, and the
    first index inside it: about a third of jnp.argmax's time on XLA:CPU (128 x 4,096: 0.9 ms ->
    0.26 ms), whose (value, index) reduction does not vectorise."""
    rows, vocab = logits.shape
    block = argmax_block(vocab)
    exact = lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if block < 16:
        return exact()

    def by_blocks():
        blocks = logits.reshape(rows, vocab // block, block)
        block_max = jnp.max(blocks, axis=-1)  # [R, NB]
        row_max = jnp.max(block_max, axis=-1, keepdims=True)  # [R, 1]
        first = jnp.argmax(block_max == row_max, axis=-1)  # [R] the first block holding the max
        inside = jnp.take_along_axis(blocks, first[:, None, None], axis=1)[:, 0]  # [R, block]
        return (first * block + jnp.argmax(inside == row_max, axis=-1)).astype(jnp.int32)

    return jax.lax.cond(maybe_nan, exact, by_blocks)


def _choose(logits, log_norm, rows: SamplerRows):
    """Tokens i32[R]: greedy rows the argmax of their (processed) logits, random rows drawn.
    `log_norm` f32[S, 1]: the raw logits' normalisers, NaN on a row holding a NaN (or +inf, or
    only -inf); the controls add no NaN to a row without one."""
    random = rows.temperature > 0
    maybe_nan = jnp.any(jnp.isnan(log_norm))

    def plain():
        # All greedy, no controls: reduce the step's rows where they lie and pick the results per
        # sample row, rather than first copying every sample row's [V] logits (the same arithmetic).
        return greedy_tokens(logits, maybe_nan)[rows.logits_rows]

    def general():
        processed = apply_controls(logits[rows.logits_rows], rows.controls)  # [R, V]

        def drawn():
            keys = row_keys(rows.seed, rows.stream, rows.position)
            return draw(processed, rows.temperature, rows.top_k, rows.top_p, rows.min_p, keys)

        no_draw = (jnp.zeros(random.shape, jnp.int32), jnp.zeros(random.shape, bool))
        picked, ok = jax.lax.cond(jnp.any(random), drawn, lambda: no_draw)
        drew = random & ok
        # The argmax pass (a third of a temperature-1 step's sampling at 128 rows) runs only when
        # some real row takes it: a greedy row, or a drawing row whose every token was masked.
        # Padding rows (temperature < 0) take none.
        argmax = lambda: greedy_tokens(processed, maybe_nan)
        tokens = jax.lax.cond(jnp.any(~drew & (rows.temperature >= 0)), argmax, lambda: no_draw[0])
        return jnp.where(drew, picked, tokens)

    return jax.lax.cond(jnp.any(random) | any_control(rows.controls), general, plain)


def _top(logits, row_max, log_norm, rows: SamplerRows, ladder: tuple[int, ...]):
    """The step's top candidates i32[R, K] and their raw log-probabilities f32[R, K] (K = the
    ladder's widest; only the first `ladder[rows.top_branch]` columns are computed, the rest 0)."""
    widest = ladder[-1]

    def top(width):
        def branch():
            top_logits, top_ids = jax.lax.top_k(logits, width)  # [S, width], log-softmax keeps the order
            top_logprobs = (top_logits - row_max) - log_norm
            pad = ((0, 0), (0, widest - width))
            return jnp.pad(top_ids.astype(jnp.int32), pad), jnp.pad(top_logprobs, pad)
        return branch

    def none():
        return jnp.zeros((logits.shape[0], widest), jnp.int32), jnp.zeros((logits.shape[0], widest), jnp.float32)

    ids, logprobs = jax.lax.switch(rows.top_branch, [none] + [top(width) for width in ladder[1:]])
    return ids[rows.logits_rows], logprobs[rows.logits_rows]


def _sample_rows(logits, rows: SamplerRows, *, ladder: tuple[int, ...]):
    """Tokens i32[R], their raw log-probabilities f32[R] and the top candidates [R, K] of `rows`
    from logits [S, V]."""
    logits = logits.astype(jnp.float32)  # [S, V]
    row_max, log_norm = normaliser(logits)  # [S, 1]: shared by every log-probability returned
    tokens = _choose(logits, log_norm, rows)
    r = rows.logits_rows
    chosen = ((logits[r, tokens] - row_max[r, 0]) - log_norm[r, 0])
    return (tokens, chosen, *_top(logits, row_max, log_norm, rows, ladder))


# One program per (S, ladder), shared by every executor of the process and kept in the executable
# store (jpaged.models.executable_store): it closes over nothing but the code.
_sample = StoredJit(_sample_rows, "sampler", static_argnames=("ladder",))

# SamplingBatch's per-row arrays (split_rows slices them)
_BATCH_ROW_FIELDS = ("logits_rows", "temperature", "top_k", "top_p", "seed", "stream", "position", "min_p")


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
        **{f: None if getattr(batch, f) is None else getattr(batch, f)[i: i + size] for f in _BATCH_ROW_FIELDS})
        for i in range(0, rows, size)]


def sample(logits: jax.Array, batch: SamplingBatch, widths: SamplerWidths | None = None) -> SampleResult:
    """Samples every row of `batch` from `logits` f32[S, vocab] with the per-row data at `widths`
    (None: the narrowest that hold the batch). Up to S rows are padded to S, so a step's shape fixes
    the sampler's program (`SamplerProgram(S)`); more rows are padded to a bucket, a program of
    their own (the executor splits them into calls of S rows instead)."""
    rows, (size, vocab) = len(batch.logits_rows), logits.shape
    size = size if rows <= size else bucket(rows)
    widths = _fitting_widths(batch, vocab) if widths is None else widths
    ladder = top_ladder(widths.num_top, vocab)
    k = batch.num_top
    if top_width(k, vocab) > ladder[-1]:
        raise ValueError(f"num_top: {k} top candidates, more than the sampler's {ladder[-1]}")

    def pad(a, dtype, fill=0):
        out = np.full(size, fill, dtype)
        out[:rows] = a
        return out

    inputs = SamplerRows(
        logits_rows=pad(batch.logits_rows, np.int32), temperature=pad(batch.temperature, np.float32, -1.0),
        top_k=pad(np.where(batch.top_k >= vocab, 0, batch.top_k), np.int32),  # (k >= V keeps every token)
        top_p=pad(batch.top_p, np.float32, 1.0), min_p=pad(0.0 if batch.min_p is None else batch.min_p, np.float32),
        seed=pad(batch.seed, np.uint32), stream=pad(batch.stream, np.int32), position=pad(batch.position, np.int32),
        top_branch=np.int32(ladder.index(top_width(k, vocab))),
        controls=padded_controls(batch.controls, size, vocab, widths.controls, getattr(logits, "sharding", None)))
    tokens, chosen, top_ids, top_logprobs = _sample(logits, inputs, ladder=tuple(ladder))
    # (the top candidates come back only when asked: [R, K] stays on device otherwise)
    tokens, chosen, *top = jax.device_get((tokens, chosen, *((top_ids, top_logprobs) if k else ())))
    return SampleResult(tokens[:rows], chosen[:rows], top[0][:rows, :k] if k else None,
                        top[1][:rows, :k] if k else None)
