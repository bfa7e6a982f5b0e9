"""Pieces shared by the kernels: the paged attention functions' argument checks, Triton shape
rules, layer-stacked pool access, query-row positions, the online-softmax steps, split-K partials.

The GPU kernels target the Pallas Triton lowering (A100, H100/H200; `backends` names the
backends and builds their compiler params). Triton needs power-of-two tensor sizes and at least
16 rows/columns per dot operand; `check_tile` enforces that in the wrappers, so a kernel that
passes in interpret mode also lowers. `launch` chooses launch shapes and checks them against the
target GPU's limits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

# Finite stand-in for -inf in masked scores: exp(MASK_VALUE - m) underflows to exactly 0 without
# creating inf - inf = NaN when a whole row is masked.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# Triton's dot (mma) needs at least this many rows, columns and contraction elements.
MIN_DOT_DIM = 16


def is_power_of_2(n: int) -> bool:
    """True for 1, 2, 4, ...; False for 0 and the rest."""
    return n > 0 and n & (n - 1) == 0


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= max(n, 1)."""
    return 1 << max(n - 1, 0).bit_length()


def decode_rows(group: int) -> int:
    """Query rows a decode program holds for a GQA group: 1 without GQA (no dot, see
    `online_softmax_step`), else the group padded to a power of two >= 16 for Triton's dot."""
    return 1 if group == 1 else max(MIN_DOT_DIM, next_power_of_2(group))


def check_tile(name: str, value: int, *, minimum: int = 1) -> None:
    """Raise ValueError unless `value` is a power of two >= `minimum` (a Triton tile rule)."""
    if not is_power_of_2(value) or value < minimum:
        raise ValueError(f"{name}: must be a power of two >= {minimum} for the Triton lowering, got {value}")


def check_knob(name: str, value: int, *, minimum: int = 1) -> None:
    """Raise ValueError unless the integer tuning knob `value` is >= `minimum`."""
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")


def _check_query_and_pools(q, k_pages, v_pages, layer, rows: str):
    """Checks q [rows, Hq, D] against the pools and returns them as a layer stack plus the layer.

    `rows` names q's first axis in error messages.
    """
    if q.ndim != 3:
        raise ValueError(f"q: expected [{rows}, num_q_heads, head_dim], got shape {q.shape}")
    k_pages, v_pages, layer = layer_stack(k_pages, v_pages, layer)
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = k_pages.shape[1]
    if k_pages.shape[4] != head_dim:
        raise ValueError(f"k_pages: head_dim {k_pages.shape[4]} must equal q head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q: num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    return k_pages, v_pages, layer


def check_decode_shapes(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D], or [L, Hkv, N, Bs, D] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # i32[B, M]
    context_lens: jax.Array,  # i32[B]
    layer: jax.Array | int | None,  # i32[]: the layer of a stacked pool, or None
) -> tuple[jax.Array, jax.Array, jax.Array]:  # ([L, Hkv, N, Bs, D], [L, Hkv, N, Bs, D], i32[])
    """The argument checks of every paged decode attention function (Pallas, XLA, native, reference).

    Args:
      q, k_pages, v_pages, block_tables, context_lens, layer: the decode functions' arguments.

    Returns:
      (k_pages, v_pages, layer): the pools as a layer stack and the layer index as i32[].

    Raises:
      ValueError naming the first argument whose shape or dtype does not fit.
    """
    k_pages, v_pages, layer = _check_query_and_pools(q, k_pages, v_pages, layer, "batch")
    batch = q.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected [batch={batch}, max_blocks], got {block_tables.shape}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens: expected [batch={batch}], got {context_lens.shape}")
    check_int32(block_tables=block_tables, context_lens=context_lens)
    return k_pages, v_pages, layer


def check_prefill_shapes(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D], or [L, Hkv, N, Bs, D] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # i32[S, M]
    context_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S + 1]
    layer: jax.Array | int | None,  # i32[]: the layer of a stacked pool, or None
) -> tuple[jax.Array, jax.Array, jax.Array]:  # ([L, Hkv, N, Bs, D], [L, Hkv, N, Bs, D], i32[])
    """The argument checks of every paged prefill attention function (Pallas, XLA, native, reference).

    Args:
      q, k_pages, v_pages, block_tables, context_lens, query_start_loc, layer: the prefill
        functions' arguments.

    Returns:
      (k_pages, v_pages, layer): the pools as a layer stack and the layer index as i32[].

    Raises:
      ValueError naming the first argument whose shape or dtype does not fit.
    """
    k_pages, v_pages, layer = _check_query_and_pools(q, k_pages, v_pages, layer, "num_tokens")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables: expected [num_seqs, max_blocks], got {block_tables.shape}")
    num_seqs = block_tables.shape[0]
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens: expected [num_seqs={num_seqs}], got {context_lens.shape}")
    if query_start_loc.shape != (num_seqs + 1,):
        raise ValueError(f"query_start_loc: expected [num_seqs + 1={num_seqs + 1}], got {query_start_loc.shape}")
    check_int32(block_tables=block_tables, context_lens=context_lens, query_start_loc=query_start_loc)
    return k_pages, v_pages, layer


def token_positions(
    query_start_loc: jax.Array,  # i32[S + 1]
    context_lens: jax.Array,  # i32[S]
    num_tokens: int,  # T
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (i32[T], i32[T], bool[T])
    """Map each query row of a prefill batch to its sequence and context position.

    Sequence s owns rows `query_start_loc[s] : query_start_loc[s + 1]`, the last tokens of its
    context.

    Returns:
      (seq_ids, positions, valid): each row's sequence, its position in that sequence's context,
      and whether any sequence owns it (for rows owned by none, the seq id and position are
      clamped into range but meaningless).
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


def check_int32(**arrays: jax.Array) -> None:
    """Raise ValueError naming the first index array that is not int32."""
    for name, arr in arrays.items():
        if arr.dtype != jnp.int32:
            raise ValueError(f"{name}: expected int32, got {arr.dtype}")


def layer_stack(k_pages: jax.Array, v_pages: jax.Array, layer) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The K/V pools as a layer stack `[L, Hkv, N, Bs, D]` and the layer to use as i32[].

    Kernels read and write one layer of the stacked pool in place: slicing `pool[layer]` out (and
    writing it back) would copy a whole layer per layer, i.e. the whole pool every step. A single
    layer `[Hkv, N, Bs, D]` with `layer=None` is viewed as a stack of one (a free reshape), so one
    code path serves both. Raises ValueError naming `k_pages`, `v_pages` or `layer`.
    """
    if layer is None:
        if k_pages.ndim != 4:
            raise ValueError(f"k_pages: without a layer index expected [num_kv_heads, num_blocks, block_size, "
                             f"head_dim], got {k_pages.shape}")
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    elif k_pages.ndim != 5:
        raise ValueError(f"k_pages: with a layer index expected [num_layers, num_kv_heads, num_blocks, block_size, "
                         f"head_dim], got {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages: shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    layer = jnp.asarray(layer)
    if layer.ndim != 0 or not jnp.issubdtype(layer.dtype, jnp.integer):
        raise ValueError(f"layer: expected an integer scalar in [0, {k_pages.shape[0]}), "
                         f"got {layer.dtype}{list(layer.shape)}")
    return k_pages, v_pages, layer.astype(jnp.int32)


def kv_dtype(pages: jax.Array) -> jnp.dtype:
    """The float dtype a KV pool holds: bfloat16 for a uint16 pool (bfloat16 stored as its bits,
    as `jpaged.models.kv_pool.storage_dtype` picks on CPU), else the pool's own dtype."""
    return jnp.dtype(jnp.bfloat16) if pages.dtype == jnp.uint16 else pages.dtype


def as_bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array as its uint16 bits (a bitcast); other dtypes unchanged.

    Gathers and scatters on the KV pool move 16-bit floats as integers: XLA:CPU has no bf16
    scatter or gather and otherwise converts the whole pool to float32 and back around each one
    (every layer, every step). Bits move exactly, so this changes no value.
    """
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """The inverse of `as_bits` for an array that had `dtype`."""
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def gather_pages(
    pages: jax.Array,  # [L, Hkv, N, Bs, D]
    layer: jax.Array,  # i32[]
    block_ids: jax.Array,  # i32[*I]
    head_axis: int = 0,
) -> jax.Array:  # [Hkv, *I, Bs, D] in kv_dtype(pages); the Hkv axis at `head_axis` of [Hkv, *I]
    """Whole blocks of one layer, read with a single gather (the layer is never sliced out first).

    The pool is viewed as rows of one (layer, KV head, block) each, [L * Hkv * N, Bs * D] (a free
    reshape), and the gather takes whole rows straight into the order the attention dots read
    (`head_axis`: where the KV-head axis goes among [Hkv, *I]). Indexing `pages[layer, :,
    block_ids]` instead gathers [*I, Hkv, Bs, D] and then transposes it: on XLA:CPU that fused
    loop runs on one thread.
    """
    num_layers, num_kv_heads, num_blocks, block_size, head_dim = pages.shape
    rows = as_bits(pages).reshape(num_layers * num_kv_heads * num_blocks, block_size * head_dim)
    heads = jnp.arange(num_kv_heads, dtype=jnp.int32)
    heads = heads.reshape([num_kv_heads if a == head_axis else 1 for a in range(block_ids.ndim + 1)])
    row_ids = (layer * num_kv_heads + heads) * num_blocks + jnp.expand_dims(block_ids, head_axis)  # i32[.., Hkv, ..]
    blocks = jnp.take(rows, row_ids, axis=0, mode="clip")  # [..., Bs * D]
    return from_bits(blocks, kv_dtype(pages)).reshape(*row_ids.shape, block_size, head_dim)


def dot_precision(dtype) -> jax.lax.Precision:
    """HIGHEST for float32: Triton runs float32 dots in TF32 otherwise, which misses 1e-4."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else jax.lax.Precision.DEFAULT


def init_softmax_state(rows: int, head_dim: int):
    """Flash-attention running state (acc f32[R, D], max f32[R], denom f32[R]) before any key."""
    return (jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def _scores(q, k):
    """q [R, D] . k [C, D]^T -> f32[R, C]. One row multiplies and reduces: a dot needs 16 rows."""
    if q.shape[0] == 1:
        return jnp.sum(q.astype(jnp.float32) * k.astype(jnp.float32), axis=1)[None, :]
    return jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=dot_precision(q.dtype),
                               preferred_element_type=jnp.float32)


def _weighted_values(p, v):
    """p f32[R, C] @ v [C, D] -> f32[R, D], with p rounded to v's dtype for the dot."""
    if p.shape[0] == 1:
        # p.sum(axis=0) drops the unit row axis ([C]); Triton's lowering has reductions, not squeezes.
        return jnp.sum(p.sum(axis=0)[:, None] * v.astype(jnp.float32), axis=0)[None, :]
    return jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=dot_precision(v.dtype),
                               preferred_element_type=jnp.float32)


def online_softmax_step(state, q, k, v, allowed, key_valid, *, scale: float):
    """Fold one chunk of keys into the running softmax state (inside a kernel body).

    q [R, D], k and v [C, D], allowed bool[R, C] (or broadcastable), key_valid bool[C]: keys that
    hold live tokens. Stale slots may hold NaN, so V rows of invalid keys are zeroed before P @ V:
    a zero probability alone would still give 0 * NaN = NaN. One query row (R = 1, decode without
    GQA) runs on the vector units instead of padding the row to a 16-row dot.
    """
    acc, m, l = state  # f32[R, D], f32[R], f32[R]
    s = _scores(q, k) * scale  # [R, C]
    s = jnp.where(allowed, s, MASK_VALUE)
    v = jnp.where(key_valid[:, None], v, jnp.zeros_like(v))
    m_next = jnp.maximum(m, s.max(axis=1))
    correction = jnp.exp(m - m_next)
    p = jnp.exp(s - m_next[:, None])  # [R, C]
    return acc * correction[:, None] + _weighted_values(p, v), m_next, l * correction + p.sum(axis=1)


def split_partials(batch: int, num_kv_heads: int, splits: int, rows: int, head_dim: int):
    """(out_specs, out_shape) of a split-K decode kernel's partials, for the (b, h, s) grid.

    Each program writes its unnormalised output f32[R, D], running max f32[R] and denominator
    f32[R] at [b, h, s]; `combine_splits` merges them.
    """
    full = (batch, num_kv_heads, splits, rows)
    out_specs = [
        pl.BlockSpec((None, None, None, rows, head_dim), lambda b, h, s: (b, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
        pl.BlockSpec((None, None, None, rows), lambda b, h, s: (b, h, s, 0)),
    ]
    out_shape = [jax.ShapeDtypeStruct(full + (head_dim,), jnp.float32), jax.ShapeDtypeStruct(full, jnp.float32),
                 jax.ShapeDtypeStruct(full, jnp.float32)]
    return out_specs, out_shape


def combine_splits(
    o: jax.Array,  # f32[B, Hkv, S, R, D]
    m: jax.Array,  # f32[B, Hkv, S, R]
    l: jax.Array,  # f32[B, Hkv, S, R]
) -> jax.Array:  # f32[B, Hkv, R, D]
    """Merge per-split softmax partials; empty splits (m = MASK_VALUE, l = 0) weigh exactly 0."""
    m_all = m.max(axis=2, keepdims=True)  # [B, Hkv, 1, R]
    weight = jnp.exp(m - m_all)  # [B, Hkv, S, R]
    denom = (weight * l).sum(axis=2)  # [B, Hkv, R]
    out = (weight[..., None] * o).sum(axis=2)  # [B, Hkv, R, D]
    # Padded sequences (length 0) have denom 0 and o 0: their output is 0.
    return out / jnp.where(denom > 0, denom, 1.0)[..., None]


def xla_softmax_init(shape: tuple[int, ...], head_dim: int):
    """Running state (acc f32[*shape, D], max f32[*shape] = -inf, denom f32[*shape]) of the XLA paths."""
    return (jnp.zeros((*shape, head_dim), jnp.float32), jnp.full(shape, -jnp.inf, jnp.float32),
            jnp.zeros(shape, jnp.float32))


def xla_softmax_step(state, q, k, v, allowed, key_valid=None, *, scale: float):
    """Fold one chunk of keys into the running softmax state of an XLA (plain jnp) path.

    q f32[X, Y, G, D]; k, v [X, Y, C, D]; allowed bool broadcastable to [X, Y, G, C] (which query
    row may see which key); key_valid bool broadcastable to [X, Y, C] (keys holding live tokens;
    default: `allowed` itself, when it does not vary over rows, as in decode). Chunks are small
    enough to stay in cache, so streaming them costs little more than reading contiguous K/V
    (materialising a whole gathered copy roughly doubles the memory traffic).
    """
    acc, m, l = state
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    live = jnp.swapaxes(allowed, -1, -2) if key_valid is None else key_valid[..., None]
    v = jnp.where(live, v, 0)  # stale slots may hold NaN: 0 * NaN = NaN
    s = jnp.einsum("xygd,xycd->xygc", q, k, precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(allowed, s, -jnp.inf)
    m_next = jnp.maximum(m, s.max(axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_next), m_next, 0.0)  # no live key yet: keep exp() finite
    correction = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[..., None])
    pv = jnp.einsum("xygc,xycd->xygd", p, v, precision=jax.lax.Precision.HIGHEST)
    return acc * correction[..., None] + pv, m_next, l * correction + p.sum(axis=-1)


def xla_softmax_finish(state) -> jax.Array:
    """acc / denom, with 0 for rows that saw no live key."""
    acc, _, l = state
    return acc / jnp.where(l > 0, l, 1.0)[..., None]


def tile_plan(query_start_loc, block_q: int, num_tiles: int):
    """Cut each sequence's query rows into tiles of `block_q`; tile i -> (sequence, first query row).

    Returns `(tile_seq i32[NT], tile_row i32[NT], tile_valid bool[NT], first_tile i32[S])`, where
    `tile_row` is the tile's first row within its sequence's query range.
    """
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # i32[S]
    tiles_per_seq = pl.cdiv(q_lens, block_q)  # i32[S]
    tile_ends = jnp.cumsum(tiles_per_seq)  # i32[S]
    first_tile = tile_ends - tiles_per_seq  # i32[S]
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    tile_seq = jnp.clip(jnp.searchsorted(tile_ends, tiles, side="right"), 0, q_lens.shape[0] - 1).astype(jnp.int32)
    tile_valid = tiles < tile_ends[-1]
    tile_row = (tiles - first_tile[tile_seq]) * block_q
    return tile_seq, tile_row, tile_valid, first_tile


def query_tiles(q, block_tables, context_lens, query_start_loc, *, num_kv_heads: int, block_q: int,
                group_pad: int, pages_per_chunk: int):
    """The Pallas prefill kernels' inputs for the tile plan of `block_q` tokens a tile (`tile_plan`;
    each sequence adds at most one partial tile to the dense cdiv(T, Bq)).

    Args: q [T, Hq, D], block_tables i32[S, M], context_lens i32[S] (clamped to the table by the
    caller), query_start_loc i32[S + 1] as the references take them; group_pad: the GQA group padded
    to a power of two (Gp); pages_per_chunk: the kernel's blocks per key step.

    Returns (meta i32[NT, 2]: each tile's context length, 0 for an empty tile, and its first query
    position; tables i32[NT, M_pad]: its sequence's block table, padded to whole key steps;
    q_tiles [NT, Hkv, Bq * Gp, D]: row r is token r // Gp, query head r % Gp of the KV head's group,
    rows past a sequence's range clamped copies, discarded by `tokens_from_tiles`; first_tile i32[S]).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    num_tiles = pl.cdiv(num_tokens, block_q) + num_seqs
    tile_seq, tile_row, tile_valid, first_tile = tile_plan(query_start_loc, block_q, num_tiles)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # i32[S]
    meta = jnp.stack([jnp.where(tile_valid, context_lens[tile_seq], 0),
                      context_lens[tile_seq] - q_lens[tile_seq] + tile_row], axis=1).astype(jnp.int32)
    tables = jnp.pad(block_tables, ((0, 0), (0, -max_blocks % pages_per_chunk)))[tile_seq]  # i32[NT, M_pad]
    token_of = query_start_loc[tile_seq][:, None] + tile_row[:, None] + jnp.arange(block_q)  # [NT, Bq]
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, group_pad - group), (0, 0)))  # [T, Hkv, Gp, D]
    q_tiles = qg[jnp.clip(token_of, 0, num_tokens - 1)]  # [NT, Bq, Hkv, Gp, D]
    q_tiles = q_tiles.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, block_q * group_pad, head_dim)
    return meta, tables, q_tiles, first_tile


def tokens_from_tiles(o_tiles, query_start_loc, context_lens, first_tile, *, num_tokens: int, block_q: int,
                      group: int):
    """A kernel's output tiles [NT, Hkv, Bq * Gp, D] (`query_tiles`' layout) in token order,
    [T, Hq, D]: token t of sequence s is row (t - start_s) % Bq of tile first_tile[s] +
    (t - start_s) // Bq; rows no sequence owns are zeros."""
    num_tiles, num_kv_heads, rows, head_dim = o_tiles.shape
    seq_ids, _, row_valid = token_positions(query_start_loc, context_lens, num_tokens)
    offset = jnp.arange(num_tokens) - query_start_loc[seq_ids]  # i32[T]
    o_tiles = o_tiles.reshape(num_tiles, num_kv_heads, block_q, rows // block_q, head_dim)
    out = o_tiles[first_tile[seq_ids] + offset // block_q, :, offset % block_q]  # [T, Hkv, Gp, D]
    out = jnp.where(row_valid[:, None, None, None], out[:, :, :group], 0)
    return out.reshape(num_tokens, num_kv_heads * group, head_dim)
