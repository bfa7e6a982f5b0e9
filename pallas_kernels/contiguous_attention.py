"""Decode attention over a contiguous (non-paged) KV cache: the baseline of the kernel benchmark.

Cache layout `[batch, num_kv_heads, max_len, head_dim]`: sequence b's tokens are rows
`0 .. context_lens[b]-1` of its own region, as in FasterTransformer / Orca. The Pallas kernel is
the paged decode kernel with the block-table lookup replaced by a contiguous slice (same grid,
GQA grouping, split-K and online softmax), so the benchmark isolates the cost of paging.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import launch
from pallas_kernels.backends import PALLAS_TRITON
from pallas_kernels.common import (
    MIN_DOT_DIM,
    check_knob,
    check_tile,
    combine_splits,
    decode_rows,
    init_softmax_state,
    online_softmax_step,
    split_partials,
    xla_softmax_finish,
    xla_softmax_init,
    xla_softmax_step,
)
from pallas_kernels.targets import current_target


def _check_shapes(q, k, v, context_lens) -> None:
    """Raise ValueError naming the first argument whose shape does not fit."""
    if q.ndim != 3:
        raise ValueError(f"q: expected [batch, num_q_heads, head_dim], got shape {q.shape}")
    batch, num_q_heads, head_dim = q.shape
    if k.ndim != 4 or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k: expected [batch={batch}, num_kv_heads, max_len, head_dim={head_dim}], got {k.shape}")
    if v.shape != k.shape:
        raise ValueError(f"v: shape {v.shape} must equal k shape {k.shape}")
    if num_q_heads % k.shape[1]:
        raise ValueError(f"q: num_q_heads {num_q_heads} must be a multiple of num_kv_heads {k.shape[1]}")
    if context_lens.shape != (batch,) or context_lens.dtype != jnp.int32:
        raise ValueError(f"context_lens: expected i32[{batch}], got {context_lens.dtype}{list(context_lens.shape)}")


@functools.partial(jax.jit, static_argnames=("scale",))
def contiguous_attention_reference(
    q: jax.Array,  # [B, Hq, D]
    k: jax.Array,  # [B, Hkv, L, D]
    v: jax.Array,  # [B, Hkv, L, D]
    context_lens: jax.Array,  # i32[B]
    *,
    scale: float,
) -> jax.Array:  # [B, Hq, D]
    """Plain-jnp masked softmax attention over a contiguous cache; the oracle.

    Args:
      q: [B, Hq, D] one query token per sequence; Hq a multiple of Hkv.
      k: [B, Hkv, L, D] each sequence's own K region.
      v: [B, Hkv, L, D] its V region.
      context_lens: i32[B] tokens of each sequence (0: a padded sequence).
      scale: the softmax scale (1 / sqrt(D)).

    Returns:
      [B, Hq, D] in q.dtype (accumulated in float32); zeros for sequences of length 0.
    """
    _check_shapes(q, k, v, context_lens)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, max_len = k.shape[1], k.shape[2]
    valid = jnp.arange(max_len)[None, :] < context_lens[:, None]  # [B, L]
    v = jnp.where(valid[:, None, :, None], v, 0).astype(jnp.float32)
    qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim).astype(jnp.float32)
    s = jnp.einsum("bhgd,bhld->bhgl", qg, k.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)  # [B, Hkv, G, L]
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgl,bhld->bhgd", p, v, precision=jax.lax.Precision.HIGHEST)
    o = o / jnp.where(denom > 0, denom, 1.0)
    return o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_k"))
def contiguous_attention_xla(
    q: jax.Array,  # [B, Hq, D]
    k: jax.Array,  # [B, Hkv, L, D]
    v: jax.Array,  # [B, Hkv, L, D]
    context_lens: jax.Array,  # i32[B]
    *,
    scale: float,
    block_k: int = 64,
) -> jax.Array:  # [B, Hq, D]
    """XLA contiguous decode attention streamed over `block_k`-token slices, the same algorithm as
    `paged_attention_xla` with slices in place of block-table gathers (the CPU baseline).

    Args:
      q: [B, Hq, D] one query token per sequence; Hq a multiple of Hkv.
      k: [B, Hkv, L, D] each sequence's own K region.
      v: [B, Hkv, L, D] its V region.
      context_lens: i32[B] tokens of each sequence (0: a padded sequence).
      scale: the softmax scale (1 / sqrt(D)).
      block_k: key tokens per slice; L must be a multiple of it.

    Returns:
      [B, Hq, D] in q.dtype (accumulated in float32); zeros for sequences of length 0.
    """
    _check_shapes(q, k, v, context_lens)
    check_knob("block_k", block_k)
    batch, num_q_heads, head_dim = q.shape
    max_len = k.shape[2]
    if max_len % block_k:
        raise ValueError(f"k: max_len {max_len} must be a multiple of block_k {block_k}")
    qg = q.reshape(batch, k.shape[1], -1, head_dim).astype(jnp.float32)  # [B, Hkv, G, D]

    def step(state, start):
        k_chunk = jax.lax.dynamic_slice_in_dim(k, start, block_k, axis=2)  # [B, Hkv, Bk, D]
        v_chunk = jax.lax.dynamic_slice_in_dim(v, start, block_k, axis=2)
        valid = start + jnp.arange(block_k)[None, :] < context_lens[:, None]  # [B, Bk]
        return xla_softmax_step(state, qg, k_chunk, v_chunk, valid[:, None, None, :], scale=scale), None

    state, _ = jax.lax.scan(step, xla_softmax_init(qg.shape[:3], head_dim), jnp.arange(0, max_len, block_k))
    return xla_softmax_finish(state).reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def _contiguous_kernel(
    lens_ref,  # i32[1]
    q_ref,  # [R, D]: the query heads of this KV head (R = 1, or the group padded to >= 16 rows)
    k_ref,  # [L, D]: this sequence's K region for this KV head
    v_ref,  # [L, D]
    o_ref,  # f32[R, D]
    m_ref,  # f32[R]
    l_ref,  # f32[R]
    *,
    scale: float,
    block_k: int,
    chunks_per_split: int,
):
    max_len, head_dim = k_ref.shape
    length = lens_ref[0]
    first_chunk = pl.program_id(2) * chunks_per_split
    num_chunks = jnp.clip(pl.cdiv(length, block_k) - first_chunk, 0, chunks_per_split)
    q = q_ref[...]

    def body(c, state):
        start = (first_chunk + c) * block_k
        k = k_ref[pl.ds(start, block_k), :]  # [Bk, D]
        v = v_ref[pl.ds(start, block_k), :]  # [Bk, D]
        valid = start + jnp.arange(block_k) < length
        return online_softmax_step(state, q, k, v, valid[None, :], valid, scale=scale)

    o, m, l = jax.lax.fori_loop(0, num_chunks, body, init_softmax_state(q.shape[0], head_dim))
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def contiguous_attention(
    q: jax.Array,  # [B, Hq, D]
    k: jax.Array,  # [B, Hkv, L, D]
    v: jax.Array,  # [B, Hkv, L, D]
    context_lens: jax.Array,  # i32[B]
    *,
    scale: float,
    block_k: int = 64,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [B, Hq, D]
    """Pallas decode attention over a contiguous cache; the reference's contract.

    Launch shapes are chosen and limits checked as `paged_attention`'s.

    Args:
      q: [B, Hq, D] one query token per sequence; Hq a multiple of Hkv.
      k: [B, Hkv, L, D] each sequence's own K region.
      v: [B, Hkv, L, D] its V region.
      context_lens: i32[B] tokens of each sequence (0: a padded sequence).
      scale: the softmax scale (1 / sqrt(D)).
      block_k: key tokens per inner step (a power of two >= 16); L must be a multiple of it.
      num_splits: context splits per (sequence, KV head); None: enough for two waves of the
        target GPU.
      num_warps: Triton's; None: from the tile (`launch`).
      num_stages: Triton's software pipelining stages.
      interpret: run the kernel in Pallas' interpreter (CPU).

    Returns:
      [B, Hq, D] in q.dtype (accumulated in float32); zeros for sequences of length 0.

    Raises:
      ValueError naming the first argument or knob that does not fit.
    """
    _check_shapes(q, k, v, context_lens)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, max_len = k.shape[1], k.shape[2]
    check_tile("head_dim", head_dim, minimum=MIN_DOT_DIM)
    check_tile("block_k", block_k, minimum=MIN_DOT_DIM)
    if max_len % block_k:
        raise ValueError(f"k: max_len {max_len} must be a multiple of block_k {block_k}")
    group = num_q_heads // num_kv_heads
    rows = decode_rows(group)
    tile = launch.Tile(rows, head_dim, k.dtype.itemsize, dots=rows > 1)
    target = current_target()
    num_warps = num_warps or tile.num_warps(block_k=block_k)
    smem = launch.check_launch("contiguous decode attention", target, tile, block_k=block_k, num_stages=num_stages,
                               num_warps=num_warps)
    num_chunks = max_len // block_k
    if num_splits is None:
        num_splits = launch.choose_num_splits(target, programs_per_split=batch * num_kv_heads,
                                              num_chunks=num_chunks, smem=smem, num_warps=num_warps)
    check_knob("num_splits", num_splits)
    chunks_per_split = pl.cdiv(num_chunks, min(num_splits, num_chunks))
    splits = pl.cdiv(num_chunks, chunks_per_split)
    lens = jnp.minimum(context_lens, max_len)
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))  # [B, Hkv, R, D]

    cache_spec = pl.BlockSpec((None, None, max_len, head_dim), lambda b, h, s: (b, h, 0, 0))
    out_specs, out_shape = split_partials(batch, num_kv_heads, splits, rows, head_dim)
    o, m, l = pl.pallas_call(
        functools.partial(_contiguous_kernel, scale=scale, block_k=block_k, chunks_per_split=chunks_per_split),
        grid=(batch, num_kv_heads, splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            cache_spec,
            cache_spec,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=PALLAS_TRITON.compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="contiguous_decode_attention",
    )(lens, qg, k, v)
    return combine_splits(o, m, l)[:, :, :group].reshape(batch, num_q_heads, head_dim).astype(q.dtype)
