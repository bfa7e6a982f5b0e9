"""Decode attention over a paged KV cache: one query token per sequence.

Pool layout per layer: `k_pages`, `v_pages` `[num_kv_heads, num_blocks, block_size, head_dim]`.
Every function also reads one layer of a layer-stacked pool `[num_layers, ...]` given `layer`, in
place (the model step passes its whole pool and a layer index; slicing would copy the layer).
Sequence `b` owns the tokens `0 .. context_lens[b]-1`, stored at
`k_pages[h, block_tables[b, t // block_size], t % block_size]`. Slots past a sequence's length
hold stale data from earlier owners (possibly NaN) and are masked so they can never reach an output.
A padded sequence has `context_lens[b] == 0` and its output is zeros.

`paged_attention` is the Pallas kernel (Triton on GPU, `interpret=True` on CPU). The grid runs
over (sequence, KV head, split): one program serves all query heads of its KV head, so each K/V
page is read once per group, and the context is split so that short batches still fill the GPU
(by default into enough splits for two waves of the target GPU, `launch.choose_num_splits`).
Without GQA the program holds a single query row and runs on the vector units; a dot would pad it
to 16 rows and write 16x the partials. Each split keeps a flash-style running max / sum and writes
an unnormalised partial output; the partials are combined after the kernel. Splits past a
sequence's length run zero loop iterations.

`paged_attention_reference` is the plain-jnp gather + softmax, the oracle. `paged_attention_xla` is
the XLA path: the same math streamed over chunks of the block table with an online softmax, so
the gathered K/V never exist as a whole copy (each chunk stays in cache). On CPU the `cpu_native`
backend's C++ kernel (`native_cpu.paged_attention_cpu`) reads the pages in place instead.
`select_impl(backend)` picks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import launch, native_cpu
from pallas_kernels.backends import PALLAS_TRITON, bind_impl
from pallas_kernels.common import (
    MIN_DOT_DIM,
    check_decode_shapes,
    check_knob,
    check_tile,
    combine_splits,
    decode_rows,
    gather_pages,
    init_softmax_state,
    online_softmax_step,
    split_partials,
    xla_softmax_finish,
    xla_softmax_init,
    xla_softmax_step,
)
from pallas_kernels.targets import current_target


@functools.partial(jax.jit, static_argnames=("scale",))
def paged_attention_reference(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D], or [L, Hkv, N, Bs, D] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # i32[B, M]
    context_lens: jax.Array,  # i32[B]
    layer: jax.Array | int | None = None,  # i32[]: the layer of a stacked pool to read
    *,
    scale: float,
) -> jax.Array:  # [B, Hq, D]
    """Plain-jnp paged decode attention: gather each sequence's pages, masked softmax, P @ V.

    The oracle of the other implementations.

    Args:
      q: [B, Hq, D] one query token per sequence; Hq a multiple of Hkv.
      k_pages: [Hkv, N, Bs, D] one layer's K pool, or [L, Hkv, N, Bs, D] a layer stack read at
        `layer`.
      v_pages: the V pool, shaped like `k_pages`.
      block_tables: i32[B, M] each sequence's physical blocks, in order.
      context_lens: i32[B] tokens of each sequence (0: a padded sequence).
      layer: i32[] the layer of a stacked pool to read; None with a single layer.
      scale: the softmax scale (1 / sqrt(D)).

    Returns:
      [B, Hq, D] in q.dtype (accumulated in float32); zeros for sequences of length 0.
    """
    k_pages, v_pages, layer = check_decode_shapes(q, k_pages, v_pages, block_tables, context_lens, layer)
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_pages.shape
    max_len = block_tables.shape[1] * block_size
    # Gather through the block table: [Hkv, B, M, Bs, D] -> [Hkv, B, L, D].
    k = gather_pages(k_pages, layer, block_tables).reshape(num_kv_heads, batch, max_len, head_dim)
    v = gather_pages(v_pages, layer, block_tables).reshape(num_kv_heads, batch, max_len, head_dim)
    valid = jnp.arange(max_len)[None, :] < context_lens[:, None]  # [B, L]
    # Zero stale V rows: masked probabilities are 0, but 0 * NaN would still be NaN.
    v = jnp.where(valid[None, :, :, None], v, 0).astype(jnp.float32)
    # KV-head-major query, so both dots batch over (Hkv, B) in the gathered K/V's own order and XLA
    # does not transpose the gathered copy.
    qg = q.reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim).swapaxes(0, 1)  # [Hkv, B, G, D]
    s = jnp.einsum("hbgd,hbld->hbgl", qg.astype(jnp.float32), k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * scale  # [Hkv, B, G, L]
    s = jnp.where(valid[None, :, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)  # [Hkv, B, G, 1]
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # empty sequences: keep exp() finite
    p = jnp.exp(s - m)  # masked entries: exp(-inf) = 0
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("hbgl,hbld->hbgd", p, v, precision=jax.lax.Precision.HIGHEST)
    o = (o / jnp.where(denom > 0, denom, 1.0)).swapaxes(0, 1)  # [B, Hkv, G, D]
    return o.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_k"))
def paged_attention_xla(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D], or [L, Hkv, N, Bs, D] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # i32[B, M]
    context_lens: jax.Array,  # i32[B]
    layer: jax.Array | int | None = None,  # i32[]: the layer of a stacked pool to read
    *,
    scale: float,
    block_k: int = 64,
) -> jax.Array:  # [B, Hq, D]
    """XLA paged decode attention: a scan over chunks of `block_k` tokens (rounded up to whole
    blocks) of every block table, gathering one chunk at a time. The reference's contract.

    Args:
      q: [B, Hq, D] one query token per sequence; Hq a multiple of Hkv.
      k_pages: [Hkv, N, Bs, D] one layer's K pool, or [L, Hkv, N, Bs, D] a layer stack read at
        `layer`.
      v_pages: the V pool, shaped like `k_pages`.
      block_tables: i32[B, M] each sequence's physical blocks, in order.
      context_lens: i32[B] tokens of each sequence (0: a padded sequence).
      layer: i32[] the layer of a stacked pool to read; None with a single layer.
      scale: the softmax scale (1 / sqrt(D)).
      block_k: key tokens per chunk (rounded up to whole blocks).

    Returns:
      [B, Hq, D] in q.dtype (accumulated in float32); zeros for sequences of length 0.
    """
    k_pages, v_pages, layer = check_decode_shapes(q, k_pages, v_pages, block_tables, context_lens, layer)
    check_knob("block_k", block_k)
    batch, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_pages.shape
    max_blocks = block_tables.shape[1]
    pages = min(max(1, block_k // block_size), max_blocks)
    steps = pl.cdiv(max_blocks, pages)
    tables = jnp.pad(block_tables, ((0, 0), (0, steps * pages - max_blocks)))  # padding -> block 0, masked
    tables = tables.reshape(batch, steps, pages).swapaxes(0, 1)  # i32[steps, B, P]
    lens = jnp.minimum(context_lens, max_blocks * block_size)  # i32[B]
    qg = q.reshape(batch, num_kv_heads, -1, head_dim).swapaxes(0, 1).astype(jnp.float32)  # [Hkv, B, G, D]
    chunk = pages * block_size

    def step(state, xs):
        table, i = xs  # i32[B, P], i32[]
        k = gather_pages(k_pages, layer, table).reshape(num_kv_heads, batch, chunk, head_dim)  # [Hkv, B, P * Bs, D]
        v = gather_pages(v_pages, layer, table).reshape(num_kv_heads, batch, chunk, head_dim)
        valid = i * chunk + jnp.arange(chunk)[None, :] < lens[:, None]  # [B, P * Bs]
        return xla_softmax_step(state, qg, k, v, valid[None, :, None, :], scale=scale), None

    state, _ = jax.lax.scan(step, xla_softmax_init(qg.shape[:3], head_dim), (tables, jnp.arange(steps)))
    out = xla_softmax_finish(state).swapaxes(0, 1)  # [B, Hkv, G, D]
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def _decode_kernel(
    layer_ref,  # i32[1]: the layer of the stacked pool to read
    lens_ref,  # i32[1]: context length of this program's sequence
    tables_ref,  # i32[pages_per_split]: this split's slice of the sequence's block table
    q_ref,  # [R, D]: the query heads of this KV head (R = 1, or the group zero-padded to >= 16 rows)
    k_ref,  # [L, N, Bs, D]: this KV head's K pool, all layers
    v_ref,  # [L, N, Bs, D]: this KV head's V pool, all layers
    o_ref,  # f32[R, D]: unnormalised partial output of this split
    m_ref,  # f32[R]: running max of this split's scores
    l_ref,  # f32[R]: softmax denominator of this split
    *,
    scale: float,
    pages_per_chunk: int,
):
    pages_per_split = tables_ref.shape[0]
    block_size, head_dim = k_ref.shape[2], k_ref.shape[3]
    chunk = pages_per_chunk * block_size
    layer, length = layer_ref[0], lens_ref[0]
    first_page = pl.program_id(2) * pages_per_split
    # Pages of this split that hold tokens; 0 for an empty split, which then skips the loop.
    num_pages = jnp.clip(pl.cdiv(length, block_size) - first_page, 0, pages_per_split)
    q = q_ref[...]  # [R, D]

    def body(c, state):
        ids = tables_ref[pl.ds(c * pages_per_chunk, pages_per_chunk)]  # i32[P]
        # Indexing the layer inside the kernel reads the pages in place: no layer slice is copied.
        k = k_ref[layer, ids].reshape(chunk, head_dim)  # [P * Bs, D]
        v = v_ref[layer, ids].reshape(chunk, head_dim)  # [P * Bs, D]
        tokens = (first_page + c * pages_per_chunk) * block_size + jnp.arange(chunk)  # [P * Bs]
        valid = tokens < length
        return online_softmax_step(state, q, k, v, valid[None, :], valid, scale=scale)

    init = init_softmax_state(q.shape[0], head_dim)
    o, m, l = jax.lax.fori_loop(0, pl.cdiv(num_pages, pages_per_chunk), body, init)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def paged_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D], or [L, Hkv, N, Bs, D] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # i32[B, M]
    context_lens: jax.Array,  # i32[B]
    layer: jax.Array | int | None = None,  # i32[]: the layer of a stacked pool to read
    *,
    scale: float,
    block_k: int = 64,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:  # [B, Hq, D]
    """Pallas paged decode attention (see the module docstring); the reference's contract.

    Args:
      q: [B, Hq, D] one query token per sequence; Hq a multiple of Hkv.
      k_pages: [Hkv, N, Bs, D] one layer's K pool, or [L, Hkv, N, Bs, D] a layer stack read at
        `layer`.
      v_pages: the V pool, shaped like `k_pages`.
      block_tables: i32[B, M] each sequence's physical blocks, in order.
      context_lens: i32[B] tokens of each sequence (0: a padded sequence).
      layer: i32[] the layer of a stacked pool to read; None with a single layer.
      scale: the softmax scale (1 / sqrt(D)).
      block_k: key tokens per inner step (rounded up to whole blocks; a power of two >= 16).
      num_splits: context splits per (sequence, KV head); None: enough for two waves of the
        target GPU. Capped by the number of steps.
      num_warps: Triton's; None: from the tile (`launch`).
      num_stages: Triton's software pipelining stages.
      interpret: run the kernel in Pallas' interpreter (CPU).

    Returns:
      [B, Hq, D] in q.dtype (accumulated in float32); zeros for sequences of length 0.

    Raises:
      ValueError naming the first argument or knob that does not fit (shapes, Triton's tile rules,
      the target GPU's limits).
    """
    k_pages, v_pages, layer = check_decode_shapes(q, k_pages, v_pages, block_tables, context_lens, layer)
    batch, num_q_heads, head_dim = q.shape
    num_layers, num_kv_heads, num_blocks, block_size, _ = k_pages.shape
    max_blocks = block_tables.shape[1]
    check_tile("head_dim", head_dim, minimum=MIN_DOT_DIM)
    check_tile("block_size", block_size)
    check_tile("block_k", block_k, minimum=MIN_DOT_DIM)
    pages_per_chunk = max(1, block_k // block_size)
    group = num_q_heads // num_kv_heads
    rows = decode_rows(group)
    tile = launch.Tile(rows, head_dim, k_pages.dtype.itemsize, dots=rows > 1)
    target = current_target()
    num_warps = num_warps or tile.num_warps(block_k=pages_per_chunk * block_size)
    smem = launch.check_launch("paged decode attention", target, tile, block_k=pages_per_chunk * block_size,
                               num_stages=num_stages, num_warps=num_warps)

    num_chunks = pl.cdiv(max_blocks, pages_per_chunk)
    if num_splits is None:
        num_splits = launch.choose_num_splits(target, programs_per_split=batch * num_kv_heads,
                                              num_chunks=num_chunks, smem=smem, num_warps=num_warps)
    check_knob("num_splits", num_splits)
    chunks_per_split = pl.cdiv(num_chunks, min(num_splits, num_chunks))
    splits = pl.cdiv(num_chunks, chunks_per_split)  # no split left without a chunk
    pages_per_split = pages_per_chunk * chunks_per_split
    # Pad the table with block 0 so every chunk load stays inside it; padded pages are masked.
    tables = jnp.pad(block_tables, ((0, 0), (0, splits * pages_per_split - max_blocks)))
    tables = tables.reshape(batch, splits, pages_per_split)  # i32[B, S, pages_per_split]
    # A length past the table would count padded block-0 slots as context.
    lens = jnp.minimum(context_lens, max_blocks * block_size)  # i32[B]
    qg = q.reshape(batch, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - group), (0, 0)))  # [B, Hkv, R, D]

    # A program sees its KV head's pages of every layer and picks the layer itself: a BlockSpec
    # index map cannot read the (traced) layer under the Triton lowering.
    pool_spec = pl.BlockSpec((num_layers, None, num_blocks, block_size, head_dim), lambda b, h, s: (0, h, 0, 0, 0))
    out_specs, out_shape = split_partials(batch, num_kv_heads, splits, rows, head_dim)
    o, m, l = pl.pallas_call(
        functools.partial(_decode_kernel, scale=scale, pages_per_chunk=pages_per_chunk),
        grid=(batch, num_kv_heads, splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, s: (0,)),
            pl.BlockSpec((1,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, None, pages_per_split), lambda b, h, s: (b, s, 0)),
            pl.BlockSpec((None, None, rows, head_dim), lambda b, h, s: (b, h, 0, 0)),
            pool_spec,
            pool_spec,
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=PALLAS_TRITON.compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(layer.reshape(1), lens, tables, qg, k_pages, v_pages)
    return combine_splits(o, m, l)[:, :, :group].reshape(batch, num_q_heads, head_dim).astype(q.dtype)


IMPLS = {"xla": paged_attention_xla, "cpu_native": native_cpu.paged_attention_cpu, "pallas_triton": paged_attention}


def select_impl(backend: str = "auto", *, interpret: bool = False, **knobs):
    """The decode attention function for `backend`.

    Args:
      backend: a name from `pallas_kernels.backends` ("auto", "xla", "cpu_native", "pallas", ...).
      interpret: for a Pallas backend, run its kernel in the interpreter.
      **knobs: for a Pallas backend, its tuning knobs (`paged_attention`'s keywords).

    Returns:
      A callable with the reference's signature `(q, k_pages, v_pages, block_tables,
      context_lens, layer=None, *, scale) -> [B, Hq, D]`.
    """
    return bind_impl(IMPLS, backend, "paged decode attention", interpret=interpret, **knobs)
