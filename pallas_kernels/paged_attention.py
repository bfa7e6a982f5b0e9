"""Decode attention over a paged KV cache: one query token per sequence.

Pool layout per layer: `k_pages`, `v_pages` `[num_kv_heads, num_blocks, block_size, head_dim]`.
Sequence `b` owns the tokens `0 .. context_lens[b]-1`, stored at
`k_pages[h, block_tables[b, t // block_size], t % block_size]`. Slots past a sequence's length
hold stale data from earlier owners (possibly NaN) and are masked so they can never reach an output.
A padded sequence has `context_lens[b] == 0` and its output is zeros.

`paged_attention_reference` is the plain-jnp gather + softmax; it is also the XLA path used on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _check_shapes(q, k_pages, v_pages, block_tables, context_lens) -> None:
    """Raise ValueError naming the first argument whose shape or dtype does not fit."""
    if q.ndim != 3:
        raise ValueError(f"q: expected [batch, num_q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages: expected [num_kv_heads, num_blocks, block_size, head_dim], got {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages: shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"k_pages: head_dim {k_pages.shape[3]} must equal q head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q: num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected [batch={batch}, max_blocks], got {block_tables.shape}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens: expected [batch={batch}], got {context_lens.shape}")
    for name, arr in (("block_tables", block_tables), ("context_lens", context_lens)):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name}: expected int32, got {arr.dtype}")


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_reference(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D]
    v_pages: jax.Array,  # [Hkv, N, Bs, D]
    block_tables: jax.Array,  # i32[B, M]
    context_lens: jax.Array,  # i32[B]
    *,
    scale: float,
) -> jax.Array:  # [B, Hq, D]
    """Plain-jnp paged decode attention: gather each sequence's pages, masked softmax, P @ V.

    Accumulates in float32 and returns `q.dtype`. Rows of sequences with `context_lens == 0` are 0.
    """
    _check_shapes(q, k_pages, v_pages, block_tables, context_lens)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    max_len = block_tables.shape[1] * block_size
    # Gather through the block table: [Hkv, B, M, Bs, D] -> [Hkv, B, L, D].
    k = k_pages[:, block_tables].reshape(num_kv_heads, batch, max_len, head_dim)
    v = v_pages[:, block_tables].reshape(num_kv_heads, batch, max_len, head_dim)
    valid = jnp.arange(max_len)[None, :] < context_lens[:, None]  # [B, L]
    # Zero stale V rows: masked probabilities are 0, but 0 * NaN would still be NaN.
    v = jnp.where(valid[None, :, :, None], v, 0).astype(jnp.float32)
    qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [B, Hkv, G, D]
    s = jnp.einsum("bhgd,hbld->bhgl", qg.astype(jnp.float32), k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * scale  # [B, Hkv, G, L]
    s = jnp.where(valid[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)  # [B, Hkv, G, 1]
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # empty sequences: keep exp() finite
    p = jnp.exp(s - m)  # masked entries: exp(-inf) = 0
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bhgl,hbld->bhgd", p, v, precision=jax.lax.Precision.HIGHEST)
    o = o / jnp.where(denom > 0, denom, 1.0)
    return o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
