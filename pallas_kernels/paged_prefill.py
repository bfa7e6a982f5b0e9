"""Prefill attention over a paged KV cache: ragged query chunks attending to cached pages + themselves.

Sequence `s` owns query rows `query_start_loc[s] : query_start_loc[s+1]`; they are the LAST `q_len`
tokens of its context (their K/V already written into its pages), so query row `i` of `s` sits at
position `context_lens[s] - q_len + i` and attends causally to positions `<=` its own. One path
serves a plain prompt, a prompt whose prefix is cached, chunked prefill and recompute after
preemption. Rows at or past `query_start_loc[S]` belong to no sequence and come out as zeros.

`paged_prefill_attention_reference` is the plain-jnp version; it is also the XLA path used on CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _check_shapes(q, k_pages, v_pages, block_tables, context_lens, query_start_loc) -> None:
    """Raise ValueError naming the first argument whose shape or dtype does not fit."""
    if q.ndim != 3:
        raise ValueError(f"q: expected [num_tokens, num_q_heads, head_dim], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages: expected [num_kv_heads, num_blocks, block_size, head_dim], got {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages: shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[0]
    if k_pages.shape[3] != head_dim:
        raise ValueError(f"k_pages: head_dim {k_pages.shape[3]} must equal q head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q: num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables: expected [num_seqs, max_blocks], got {block_tables.shape}")
    num_seqs = block_tables.shape[0]
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens: expected [num_seqs={num_seqs}], got {context_lens.shape}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc: expected [num_seqs + 1={num_seqs + 1}], got {query_start_loc.shape}")
    for name, arr in (("block_tables", block_tables), ("context_lens", context_lens),
                      ("query_start_loc", query_start_loc)):
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name}: expected int32, got {arr.dtype}")


def token_positions(query_start_loc: jax.Array, context_lens: jax.Array, num_tokens: int):
    """Map each query row to its sequence and context position.

    Returns `(seq_ids i32[T], positions i32[T], valid bool[T])`; rows owned by no sequence have
    `valid == False` (their seq id and position are clamped into range but meaningless).
    """
    rows = jnp.arange(num_tokens, dtype=jnp.int32)  # [T]
    num_seqs = context_lens.shape[0]
    # Row t belongs to the last sequence whose start is <= t; empty ranges are skipped by side="right".
    seq_ids = jnp.searchsorted(query_start_loc, rows, side="right").astype(jnp.int32) - 1
    seq_ids = jnp.clip(seq_ids, 0, num_seqs - 1)
    start, end = query_start_loc[seq_ids], query_start_loc[seq_ids + 1]
    valid = (rows >= start) & (rows < end)
    positions = context_lens[seq_ids] - (end - start) + (rows - start)
    return seq_ids, positions, valid


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_prefill_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D]
    v_pages: jax.Array,  # [Hkv, N, Bs, D]
    block_tables: jax.Array,  # i32[S, M]
    context_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S + 1]
    *,
    scale: float,
) -> jax.Array:  # [T, Hq, D]
    """Plain-jnp paged prefill attention, causal with the cached-context offset.

    Scans over sequences so memory stays at one sequence's `[T, Hq, L]` scores; each step fills the
    rows that sequence owns. Accumulates in float32 and returns `q.dtype`.
    """
    _check_shapes(q, k_pages, v_pages, block_tables, context_lens, query_start_loc)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size
    seq_ids, positions, row_valid = token_positions(query_start_loc, context_lens, num_tokens)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)  # [T, Hkv, G, D]
    key_pos = jnp.arange(max_len)  # [L]

    def one_sequence(out, seq):
        table, length, seq_id = seq  # i32[M], i32[], i32[]
        k = k_pages[:, table].reshape(num_kv_heads, max_len, head_dim).astype(jnp.float32)  # [Hkv, L, D]
        v = v_pages[:, table].reshape(num_kv_heads, max_len, head_dim).astype(jnp.float32)
        # Zero stale V rows: masked probabilities are 0, but 0 * NaN would still be NaN.
        v = jnp.where((key_pos < length)[None, :, None], v, 0)
        owned = row_valid & (seq_ids == seq_id)  # [T]
        allowed = owned[:, None] & (key_pos[None, :] <= positions[:, None]) & (key_pos[None, :] < length)  # [T, L]
        s = jnp.einsum("thgd,hld->thgl", qg, k, precision=jax.lax.Precision.HIGHEST) * scale
        s = jnp.where(allowed[:, None, None, :], s, -jnp.inf)  # [T, Hkv, G, L]
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)  # rows this sequence does not own: keep exp() finite
        p = jnp.exp(s - m)
        denom = jnp.sum(p, axis=-1, keepdims=True)
        o = jnp.einsum("thgl,hld->thgd", p, v, precision=jax.lax.Precision.HIGHEST)
        o = o / jnp.where(denom > 0, denom, 1.0)
        return out + jnp.where(owned[:, None, None, None], o, 0), None

    seqs = (block_tables, context_lens, jnp.arange(block_tables.shape[0], dtype=jnp.int32))
    out, _ = jax.lax.scan(one_sequence, jnp.zeros_like(qg), seqs)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
