"""The device half of the sampling controls: vLLM's logits processors and penalties on [R, V] logits.

In vLLM v1's order (vllm/v1/sample/sampler.py): allowed tokens, banned tokens (bad words, and
min_tokens' stop ids), logit_bias, then the penalties (repetition over prompt and output tokens,
frequency and presence over output tokens). Each row reads only its own entries of the compact
arrays the host built (jpaged.core.sampling_controls); padding ids fall outside the vocabulary and
are dropped by the scatters, so a row's result does not depend on the widths. The lists have
fixed widths (`ControlWidths`, from the engine's limits) and every control is present in every
step, neutral where unused: the sampler compiles one program whatever the controls. The neutral
arrays are placed on the device once per row count and reused, so a step sends only the fields
its rows use (a step without controls: a bool[4] of flags).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jpaged.core.constraints import bitmask_words
from jpaged.core.sampling_controls import PAD_ID, SamplingControls


class ControlWidths(NamedTuple):
    """The fixed widths of the controls' per-row id lists: with the row count, their whole shape."""

    history: int  # L: tokens a row's penalties count (prompt and output: `history_width(max_model_len)`)
    bias: int  # B: logit_bias entries of a row (MAX_LOGIT_BIAS_IDS)
    banned: int  # N: ids a row may have banned in one step (MAX_BANNED_IDS)


class DeviceControls(NamedTuple):
    """SamplingControls of R rows at fixed widths, every field present (neutral where a row has
    none), as device arrays: one shape for every mix of controls."""

    used: np.ndarray  # bool[4] some row is restricted, has banned ids, a logit_bias, penalties (host-set)
    penalties: jax.Array  # f32[R, 3] presence, frequency, repetition (neutral 0, 0, 1)
    history: jax.Array  # i32[R, L] tokens the penalties see, PAD_ID after
    output_start: jax.Array  # i32[R] first output token's index in history
    bias_ids: jax.Array  # i32[R, B], PAD_ID after
    bias_values: jax.Array  # f32[R, B]
    banned: jax.Array  # i32[R, N], PAD_ID after
    allowed: jax.Array  # i32[R, ceil(V / 32)] allowed-token bits (-1: every token)


_NEUTRAL_PENALTIES = np.array([0.0, 0.0, 1.0], np.float32)
# DeviceControls' per-row fields: all but `used`
_ROW_FIELDS = DeviceControls._fields[1:]


@functools.lru_cache(maxsize=64)
def _neutral_host(size: int, vocab: int, widths: ControlWidths) -> dict[str, np.ndarray]:
    """The per-row fields of `size` rows none of which has a control, in host memory (read-only,
    shared: a step's present fields start from copies of these)."""
    out = {"penalties": np.tile(_NEUTRAL_PENALTIES, (size, 1)),
           "history": np.full((size, widths.history), PAD_ID, np.int32),
           "output_start": np.zeros(size, np.int32),
           "bias_ids": np.full((size, widths.bias), PAD_ID, np.int32),
           "bias_values": np.zeros((size, widths.bias), np.float32),
           "banned": np.full((size, widths.banned), PAD_ID, np.int32),
           "allowed": np.full((size, bitmask_words(vocab)), -1, np.int32)}
    for a in out.values():
        a.flags.writeable = False
    return out


@functools.lru_cache(maxsize=64)
def _neutral_device(size: int, vocab: int, widths: ControlWidths, sharding: jax.sharding.Sharding
                    ) -> dict[str, jax.Array]:
    """`_neutral_host` placed once with `sharding` (the logits'): a step passes these for every
    field none of its rows uses, so a step without controls copies none of them to the device
    (R x (L + 2B + N + ceil(V / 32) + 4) x 4 bytes: 3.0 MB at 256 rows, L 2,048, B = N = 256,
    V 4,096). Committed arrays of one shape and sharding: the sampler's program is the same
    whichever fields come from here."""
    return {name: jax.device_put(a, sharding) for name, a in _neutral_host(size, vocab, widths).items()}


def _fixed_width(field: str, a: np.ndarray, width: int, fill) -> np.ndarray:
    """`a` [R, w] as [R, width]: entries past `width` must all be `fill` (the lists' padding)."""
    if a.shape[1] > width and (a[:, width:] != fill).any():
        raise ValueError(f"{field}: a row has more than {width} entries, the sampler's fixed width")
    out = np.full((len(a), width), fill, a.dtype)
    out[:, : min(width, a.shape[1])] = a[:, :width]
    return out


def _host_fields(controls: SamplingControls, size: int, vocab: int, widths: ControlWidths) -> dict[str, np.ndarray]:
    """The per-row fields some row of `controls` uses, as host arrays of `size` rows at `widths`."""
    neutral = _neutral_host(size, vocab, widths)
    fields = {}

    def rows(name, a, fill, width=None):
        if a is None:
            return
        if width is not None:
            a = _fixed_width(name, a, width, fill)
        out = neutral[name].copy()
        out[: len(a)] = a
        fields[name] = out

    rows("penalties", controls.penalties, 0.0)
    rows("history", controls.history, PAD_ID, widths.history)
    rows("output_start", controls.output_start, 0)
    rows("bias_ids", controls.bias_ids, PAD_ID, widths.bias)
    rows("bias_values", controls.bias_values, 0.0, widths.bias)
    rows("banned", controls.banned, PAD_ID, widths.banned)
    if controls.allowed_masks is not None:
        words = bitmask_words(vocab)
        masks = controls.allowed_masks
        if masks.shape[1] > words and masks[:, words:].any():
            raise ValueError(f"allowed token masks reach past the vocabulary of {vocab} tokens")
        allowed = neutral["allowed"].copy()
        allowed[controls.allowed_rows] = 0
        width = min(words, masks.shape[1])
        allowed[controls.allowed_rows, :width] = masks[:, :width]
        fields["allowed"] = allowed
    return fields


def padded_controls(controls: SamplingControls | None, size: int, vocab: int, widths: ControlWidths,
                    sharding: jax.sharding.Sharding | None = None) -> DeviceControls:
    """`controls` of R rows (None: no row has any) as DeviceControls of `size` >= R rows over a
    vocabulary of `vocab`, placed with `sharding` (None: the default device): lists at the fixed
    `widths`, padding rows and absent fields neutral, allowed masks widened to the vocabulary's
    words (unrestricted rows all ones; a restricted row allows nothing past its own mask). Only the
    fields some row uses are copied to the device; the others are the cached neutral arrays."""
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    fields = {} if controls is None else _host_fields(controls, size, vocab, widths)
    neutral = _neutral_device(size, vocab, widths, sharding)
    # (the flags are set from the fields present, not read off the device arrays: a step of a
    # control's neutral rows alone runs it, exactly)
    used = np.array([name in fields for name in ("allowed", "banned", "bias_ids", "penalties")])
    return DeviceControls(used=used, **{name: jax.device_put(fields[name], sharding) if name in fields
                                        else neutral[name] for name in _ROW_FIELDS})


def apply_controls(logits: jax.Array, c: DeviceControls) -> jax.Array:
    """The processed logits f32[R, V]: masks, bias and penalties of every row (neutral rows exact).
    Each control runs only when some row of the step has it (`lax.cond` on `c.used`): one program
    for every mix, and a step pays only for the controls it uses."""
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]

    def allowed(logits):
        bits = (c.allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [R, W, 32]
        return jnp.where(bits.reshape(num_rows, -1)[:, :vocab] == 1, logits, -jnp.inf)

    def banned(logits):
        return logits.at[rows, c.banned].set(-jnp.inf, mode="drop")

    def bias(logits):
        return logits.at[rows, c.bias_ids].add(c.bias_values, mode="drop")

    def penalties(logits):
        seen = jnp.zeros((num_rows, vocab), bool).at[rows, c.history].set(True, mode="drop")  # prompt or output
        in_output = (jnp.arange(c.history.shape[1]) >= c.output_start[:, None]).astype(jnp.int32)
        counts = jnp.zeros((num_rows, vocab), jnp.int32).at[rows, c.history].add(in_output, mode="drop")
        presence, frequency, repetition = (c.penalties[:, i: i + 1] for i in range(3))
        # vLLM's arithmetic: multiply by 1 / penalty (not divide) where the logit is positive; each
        # product rounded on its own, as torch's separate operations round it. (Behind a select,
        # which XLA:CPU's LLVM cannot contract with the subtraction into one multiply-add.)
        logits = jnp.where(seen, logits * jnp.where(logits > 0, 1.0 / repetition, repetition), logits)
        logits = logits - jnp.where(counts > 0, frequency * counts.astype(jnp.float32), 0.0)
        return logits - jnp.where(counts > 0, presence, 0.0)

    for i, control in enumerate((allowed, banned, bias, penalties)):
        logits = jax.lax.cond(c.used[i], control, lambda logits: logits, logits)
    return logits


def any_control(c: DeviceControls) -> jax.Array:
    """bool[]: some row of `c` has a control."""
    return jnp.any(c.used)
