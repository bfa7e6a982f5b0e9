"""Prefill attention over a paged KV cache: ragged query chunks attending to cached pages + themselves.

Sequence `s` owns query rows `query_start_loc[s] : query_start_loc[s+1]`; they are the LAST `q_len`
tokens of its context (their K/V already written into its pages), so query row `i` of `s` sits at
position `context_lens[s] - q_len + i` and attends causally to positions `<=` its own. One path
serves a plain prompt, a prompt whose prefix is cached, chunked prefill and recompute after
preemption, and a mixed batch in which decode sequences (one query each) ride along with long
chunks. Rows at or past `query_start_loc[S]` belong to no sequence and come out as zeros.
Pools are one layer `[Hkv, N, Bs, D]`, or a layer stack `[L, Hkv, N, Bs, D]` read in place at `layer`.

`paged_prefill_attention` is the Pallas kernel (Triton on GPU, `interpret=True` on CPU). The
wrapper cuts every sequence's query rows into tiles of `block_q` tokens (a tile never straddles two
sequences) and gathers them into a dense `[tiles, Hkv, block_q * Gp, D]` array, one row per
(token, query head of the group). The grid runs over (tile, KV head); each program streams the
sequence's pages up to its last query position through the block table with a flash-style online
softmax, so K/V are read once per group. Tiles past the real ones are empty and loop zero times.
The wrapper scatters tile rows back to token order. Tiles default to 64 rows (a longer chunk
re-reads its sequence's K/V once per tile); a decode sequence costs one tile per KV head.

`paged_prefill_attention_reference` is the plain-jnp oracle (a scan over sequences);
`paged_prefill_attention_xla` the XLA path (the kernel's tile plan, vectorised); on CPU the
`cpu_native` backend's C++ kernel (`native_cpu.paged_prefill_attention_cpu`) reads the pages in
place instead. `select_impl(backend)` picks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import launch, native_cpu, paged_attention_mgpu
from pallas_kernels.backends import PALLAS_TRITON, bind_impl
from pallas_kernels.common import (
    MIN_DOT_DIM,
    check_knob,
    check_prefill_shapes,
    check_tile,
    gather_pages,
    init_softmax_state,
    next_power_of_2,
    online_softmax_step,
    query_tiles,
    tile_plan,
    token_positions,
    tokens_from_tiles,
    xla_softmax_finish,
    xla_softmax_init,
    xla_softmax_step,
)
from pallas_kernels.targets import current_target

# Query rows (tokens x padded GQA group) per tile by default: long chunks re-read each sequence's
# K/V once per tile, so larger tiles read less; 64 rows at block_k 64 compile without spills.
DEFAULT_TILE_ROWS = 64


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_prefill_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D], or [L, Hkv, N, Bs, D] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # i32[S, M]
    context_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S + 1]
    layer: jax.Array | int | None = None,  # i32[]: the layer of a stacked pool to read
    *,
    scale: float,
) -> jax.Array:  # [T, Hq, D]
    """Plain-jnp paged prefill attention, causal with the cached-context offset; the oracle.

    Scans over sequences so memory stays at one sequence's `[T, Hq, L]` scores; each step fills the
    rows that sequence owns.

    Args:
      q: [T, Hq, D] the batch's query tokens, sequence by sequence; Hq a multiple of Hkv.
      k_pages: [Hkv, N, Bs, D] one layer's K pool, or [L, Hkv, N, Bs, D] a layer stack read at
        `layer`.
      v_pages: the V pool, shaped like `k_pages`.
      block_tables: i32[S, M] each sequence's physical blocks, in order.
      context_lens: i32[S] tokens of each sequence, its query tokens included (0: padding).
      query_start_loc: i32[S + 1] sequence s owns query rows [query_start_loc[s],
        query_start_loc[s + 1]), the last tokens of its context.
      layer: i32[] the layer of a stacked pool to read; None with a single layer.
      scale: the softmax scale (1 / sqrt(D)).

    Returns:
      [T, Hq, D] in q.dtype (accumulated in float32); zeros for rows no sequence owns.
    """
    k_pages, v_pages, layer = check_prefill_shapes(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, layer)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size
    seq_ids, positions, row_valid = token_positions(query_start_loc, context_lens, num_tokens)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(jnp.float32)  # [T, Hkv, G, D]
    key_pos = jnp.arange(max_len)  # [L]

    def one_sequence(out, seq):
        table, length, seq_id = seq  # i32[M], i32[], i32[]
        k = gather_pages(k_pages, layer, table).reshape(num_kv_heads, max_len, head_dim)  # [Hkv, L, D]
        v = gather_pages(v_pages, layer, table).reshape(num_kv_heads, max_len, head_dim)
        k, v = k.astype(jnp.float32), v.astype(jnp.float32)
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


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_chunk"))
def paged_prefill_attention_xla(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D], or [L, Hkv, N, Bs, D] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # i32[S, M]
    context_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S + 1]
    layer: jax.Array | int | None = None,  # i32[]: the layer of a stacked pool to read
    *,
    scale: float,
    block_q: int = 32,
    # 4 x 16-token pages: each chunk's gathered K/V of all tiles ([NT, Hkv, C, D]) then stays near
    # cache size (larger chunks leave the cache).
    pages_per_chunk: int = 4,
) -> jax.Array:  # [T, Hq, D]
    """The XLA path of paged prefill (CPU): query tiles of one sequence each, keys streamed in chunks.

    The same tile plan as the Pallas kernel, vectorised: every tile attends to its sequence's pages
    chunk by chunk with an online softmax, so work is ~ tiles x context rather than the
    reference's sequences x all tokens x context, and no sequence's gathered K/V exists whole.

    Args:
      q: [T, Hq, D] the batch's query tokens, sequence by sequence; Hq a multiple of Hkv.
      k_pages: [Hkv, N, Bs, D] one layer's K pool, or [L, Hkv, N, Bs, D] a layer stack read at
        `layer`.
      v_pages: the V pool, shaped like `k_pages`.
      block_tables: i32[S, M] each sequence's physical blocks, in order.
      context_lens: i32[S] tokens of each sequence, its query tokens included (0: padding).
      query_start_loc: i32[S + 1] sequence s owns query rows [query_start_loc[s],
        query_start_loc[s + 1]), the last tokens of its context.
      layer: i32[] the layer of a stacked pool to read; None with a single layer.
      scale: the softmax scale (1 / sqrt(D)).
      block_q: query tokens per tile (fewer for a batch of fewer tokens).
      pages_per_chunk: blocks of keys per streamed chunk.

    Returns:
      [T, Hq, D] in q.dtype (accumulated in float32); zeros for rows no sequence owns.
    """
    k_pages, v_pages, layer = check_prefill_shapes(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, layer)
    check_knob("block_q", block_q)
    check_knob("pages_per_chunk", pages_per_chunk)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_pages.shape
    group = num_q_heads // num_kv_heads
    num_seqs, max_blocks = block_tables.shape
    block_q = min(block_q, next_power_of_2(num_tokens))  # small batches: no tile larger than the batch
    num_tiles = pl.cdiv(num_tokens, block_q) + num_seqs  # each sequence adds at most one partial tile
    tile_seq, tile_row, tile_valid, _ = tile_plan(query_start_loc, block_q, num_tiles)  # [NT] each
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # i32[S]
    row_in_seq = tile_row[:, None] + jnp.arange(block_q)[None, :]  # [NT, Bq]
    row_ok = tile_valid[:, None] & (row_in_seq < q_lens[tile_seq][:, None])  # [NT, Bq]
    rows = jnp.where(row_ok, query_start_loc[tile_seq][:, None] + row_in_seq, num_tokens)  # T = dropped
    positions = (context_lens - q_lens)[tile_seq][:, None] + row_in_seq  # [NT, Bq]
    qt = q[jnp.minimum(rows, num_tokens - 1)].astype(jnp.float32)  # [NT, Bq, Hq, D]
    # Rows of a tile and query heads of a KV-head group share that head's keys: [NT, Hkv, Bq * G, D].
    qt = qt.reshape(num_tiles, block_q, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
    qt = qt.reshape(num_tiles, num_kv_heads, block_q * group, head_dim)
    row_pos = jnp.repeat(positions, group, axis=1)  # [NT, Bq * G]
    lengths = jnp.where(tile_valid, context_lens[tile_seq], 0)  # [NT]
    pad = -max_blocks % pages_per_chunk
    tables = jnp.pad(block_tables, ((0, 0), (0, pad)))[tile_seq]  # [NT, M_pad]; pad entries -> block 0
    chunk = pages_per_chunk * block_size

    def body(c, state):
        ids = jax.lax.dynamic_slice_in_dim(tables, c * pages_per_chunk, pages_per_chunk, axis=1)  # [NT, P]
        # Gathered tile-major, [NT, Hkv, C, D]: the order of the tiles' queries, no transpose.
        k = gather_pages(k_pages, layer, ids, head_axis=1).reshape(num_tiles, num_kv_heads, chunk, head_dim)
        v = gather_pages(v_pages, layer, ids, head_axis=1).reshape(num_tiles, num_kv_heads, chunk, head_dim)
        keys = c * chunk + jnp.arange(chunk)  # [C]
        key_valid = keys[None, :] < lengths[:, None]  # [NT, C]
        allowed = key_valid[:, None, :] & (keys[None, None, :] <= row_pos[:, :, None])  # [NT, R, C]
        return xla_softmax_step(state, qt, k, v, allowed[:, None], key_valid[:, None], scale=scale)

    num_chunks = pl.cdiv(jnp.max(lengths), chunk)
    state = xla_softmax_init((num_tiles, num_kv_heads, block_q * group), head_dim)
    out = xla_softmax_finish(jax.lax.fori_loop(0, num_chunks, body, state))  # [NT, Hkv, Bq * G, D]
    out = out.reshape(num_tiles, num_kv_heads, block_q, group, head_dim).transpose(0, 2, 1, 3, 4)
    out = out.reshape(num_tiles * block_q, num_q_heads, head_dim).astype(q.dtype)
    result = jnp.zeros((num_tokens, num_q_heads, head_dim), q.dtype)
    return result.at[rows.reshape(-1)].set(out, mode="drop")  # rows owned by no sequence stay 0


def _prefill_kernel(
    layer_ref,  # i32[1]: the layer of the stacked pool to read
    meta_ref,  # i32[2]: (context length, position of the tile's first query row); length 0 = empty tile
    tables_ref,  # i32[M_pad]: block table of the tile's sequence
    q_ref,  # [Bq * Gp, D]: row r is token r // Gp, query head r % Gp of this KV head's group
    k_ref,  # [L, N, Bs, D]: this KV head's K pool, all layers
    v_ref,  # [L, N, Bs, D]: this KV head's V pool, all layers
    o_ref,  # [Bq * Gp, D]
    *,
    scale: float,
    group_pad: int,
    pages_per_chunk: int,
):
    rows, head_dim = q_ref.shape
    block_size = k_ref.shape[2]
    chunk = pages_per_chunk * block_size
    layer, length, first_pos = layer_ref[0], meta_ref[0], meta_ref[1]
    positions = first_pos + jnp.arange(rows) // group_pad  # [Bq * Gp]
    # Causal: the tile needs keys up to its last row's position (never past the context).
    num_keys = jnp.minimum(length, first_pos + rows // group_pad)
    q = q_ref[...]

    def body(c, state):
        ids = tables_ref[pl.ds(c * pages_per_chunk, pages_per_chunk)]  # i32[P]
        # Indexing the layer inside the kernel reads the pages in place: no layer slice is copied.
        k = k_ref[layer, ids].reshape(chunk, head_dim)  # [P * Bs, D]
        v = v_ref[layer, ids].reshape(chunk, head_dim)  # [P * Bs, D]
        keys = c * chunk + jnp.arange(chunk)  # [P * Bs]
        in_context = keys < length
        allowed = in_context[None, :] & (keys[None, :] <= positions[:, None])  # [R, P * Bs]
        return online_softmax_step(state, q, k, v, allowed, in_context, scale=scale)

    o, _, l = jax.lax.fori_loop(0, pl.cdiv(num_keys, chunk), body, init_softmax_state(rows, head_dim))
    o_ref[...] = (o / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_k", "num_warps", "num_stages",
                                             "interpret"))
def paged_prefill_attention(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D], or [L, Hkv, N, Bs, D] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # i32[S, M]
    context_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S + 1]
    layer: jax.Array | int | None = None,  # i32[]: the layer of a stacked pool to read
    *,
    scale: float,
    block_q: int | None = None,
    block_k: int = 64,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """Pallas paged prefill attention (see the module docstring); the reference's contract.

    Args:
      q: [T, Hq, D] the batch's query tokens, sequence by sequence; Hq a multiple of Hkv.
      k_pages: [Hkv, N, Bs, D] one layer's K pool, or [L, Hkv, N, Bs, D] a layer stack read at
        `layer`.
      v_pages: the V pool, shaped like `k_pages`.
      block_tables: i32[S, M] each sequence's physical blocks, in order.
      context_lens: i32[S] tokens of each sequence, its query tokens included (0: padding).
      query_start_loc: i32[S + 1] sequence s owns query rows [query_start_loc[s],
        query_start_loc[s + 1]), the last tokens of its context.
      layer: i32[] the layer of a stacked pool to read; None with a single layer.
      scale: the softmax scale (1 / sqrt(D)).
      block_q: query tokens per tile, a power of two; `block_q * Gp` rows (Gp: the GQA group
        padded to a power of two) must be >= 16. None: DEFAULT_TILE_ROWS rows, fewer for a batch
        of fewer tokens.
      block_k: key tokens per inner step (rounded up to whole blocks; a power of two >= 16).
      num_warps: Triton's; None: from the tile (`launch`).
      num_stages: Triton's software pipelining stages.
      interpret: run the kernel in Pallas' interpreter (CPU).

    Returns:
      [T, Hq, D] in q.dtype (accumulated in float32); zeros for rows no sequence owns.

    Raises:
      ValueError naming the first argument or knob that does not fit (shapes, Triton's tile rules,
      the target GPU's limits).
    """
    k_pages, v_pages, layer = check_prefill_shapes(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, layer)
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, num_blocks, block_size, _ = k_pages.shape
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    check_tile("head_dim", head_dim, minimum=MIN_DOT_DIM)
    check_tile("block_size", block_size)
    check_tile("block_k", block_k, minimum=MIN_DOT_DIM)
    if block_q is None:
        min_block_q = max(1, MIN_DOT_DIM // group_pad)
        block_q = max(min_block_q, min(DEFAULT_TILE_ROWS // group_pad, next_power_of_2(num_tokens)))
    check_tile("block_q", block_q)
    check_tile("block_q * padded GQA group", block_q * group_pad, minimum=MIN_DOT_DIM)
    pages_per_chunk = max(1, block_k // block_size)
    rows = block_q * group_pad
    tile = launch.Tile(rows, head_dim, k_pages.dtype.itemsize)
    num_warps = num_warps or tile.num_warps(block_k=pages_per_chunk * block_size)
    launch.check_launch("paged prefill attention", current_target(), tile, block_k=pages_per_chunk * block_size,
                        num_stages=num_stages, num_warps=num_warps)
    # Clamp as the reference's mask does: a length past the table would count block-0 padding.
    lens = jnp.minimum(context_lens, max_blocks * block_size)  # i32[S]
    meta, tables, q_tiles, first_tile = query_tiles(q, block_tables, lens, query_start_loc, num_kv_heads=num_kv_heads,
                                                    block_q=block_q, group_pad=group_pad,
                                                    pages_per_chunk=pages_per_chunk)
    num_tiles = meta.shape[0]

    # A program sees its KV head's pages of every layer and picks the layer itself: a BlockSpec
    # index map cannot read the (traced) layer under the Triton lowering.
    pool_spec = pl.BlockSpec((num_layers, None, num_blocks, block_size, head_dim), lambda t, h: (0, h, 0, 0, 0))
    row_spec = pl.BlockSpec((None, None, rows, head_dim), lambda t, h: (t, h, 0, 0))
    o_tiles = pl.pallas_call(
        functools.partial(_prefill_kernel, scale=scale, group_pad=group_pad, pages_per_chunk=pages_per_chunk),
        grid=(num_tiles, num_kv_heads),
        in_specs=[
            pl.BlockSpec((1,), lambda t, h: (0,)),
            pl.BlockSpec((None, 2), lambda t, h: (t, 0)),
            pl.BlockSpec((None, tables.shape[1]), lambda t, h: (t, 0)),
            row_spec,
            pool_spec,
            pool_spec,
        ],
        out_specs=row_spec,
        out_shape=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows, head_dim), q.dtype),
        compiler_params=PALLAS_TRITON.compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_prefill_attention",
    )(layer.reshape(1), meta, tables, q_tiles, k_pages, v_pages)

    return tokens_from_tiles(o_tiles, query_start_loc, context_lens, first_tile, num_tokens=num_tokens,
                             block_q=block_q, group=group)


def mosaic_gpu_or_triton(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, layer=None, *,
                         scale: float, interpret: bool = False, **knobs) -> jax.Array:
    """The `pallas_mosaic_gpu` backend: the Mosaic GPU kernel (`paged_attention_mgpu`) where it
    takes the shape, else the Triton kernel (`paged_prefill_attention`, with `knobs`)."""
    group = q.shape[1] // k_pages.shape[-4]
    if paged_attention_mgpu.supports(q.dtype, q.shape[2], k_pages.shape[-2], group) and k_pages.dtype == q.dtype:
        return paged_attention_mgpu.paged_attention_mgpu(q, k_pages, v_pages, block_tables, context_lens,
                                                         query_start_loc, layer, scale=scale, interpret=interpret)
    return paged_prefill_attention(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, layer,
                                   scale=scale, interpret=interpret, **knobs)


IMPLS = {"xla": paged_prefill_attention_xla, "cpu_native": native_cpu.paged_prefill_attention_cpu,
         "pallas_triton": paged_prefill_attention, "pallas_mosaic_gpu": mosaic_gpu_or_triton}


def select_impl(backend: str = "auto", *, interpret: bool = False, **knobs):
    """The prefill attention function for `backend`.

    Args:
      backend: a name from `pallas_kernels.backends` ("auto", "xla", "cpu_native", "pallas", ...).
      interpret: for a Pallas backend, run its kernel in the interpreter.
      **knobs: for a Pallas backend, its tuning knobs (`paged_prefill_attention`'s keywords).

    Returns:
      A callable with the reference's signature `(q, k_pages, v_pages, block_tables,
      context_lens, query_start_loc, layer=None, *, scale) -> [T, Hq, D]`.
    """
    return bind_impl(IMPLS, backend, "paged prefill attention", interpret=interpret, **knobs)
