"""Cache updates on the paged KV pool, in place: write new K/V by slot, copy blocks, swap blocks.

Per-layer pool layout: `[num_kv_heads, num_blocks, block_size, head_dim]`; the model keeps all
layers in one stack `[L, Hkv, N, Bs, D]`. `write_kv` writes one layer of either (`layer=i` for the
stack). `copy_blocks`, `gather_blocks` and `scatter_blocks` accept any pool whose block axis is -3
(`[..., num_blocks, block_size, head_dim]`), so the stacked pool is updated in one call. The
updating functions donate the pool: XLA then performs the scatter in the pool's own buffer instead
of copying the whole pool (tests check the buffer pointer is unchanged).
The caller must use the returned arrays; the donated inputs are invalid afterwards.

Block 0 is the reserved padding target: padded slots (slot < 0) and padding block ids/pairs point
at it, so padding never touches a live block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.common import as_bits, from_bits, kv_dtype, layer_stack


def _check_pool(name: str, pages: jax.Array) -> None:
    if pages.ndim < 3:
        raise ValueError(f"{name}: expected [..., num_blocks, block_size, head_dim], got shape {pages.shape}")


def _check_int32(name: str, arr: jax.Array, ndim: int) -> None:
    if arr.ndim != ndim or arr.dtype != jnp.int32:
        raise ValueError(f"{name}: expected int32 with {ndim} dims, got {arr.dtype}{list(arr.shape)}")


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_kv(
    k_pages: jax.Array,  # [Hkv, N, Bs, D], or [L, Hkv, N, Bs, D] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    k_new: jax.Array,  # [T, Hkv, D]
    v_new: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]
    layer: jax.Array | int | None = None,  # i32[]: the layer of a stacked pool to write
) -> tuple[jax.Array, jax.Array]:  # (k_pages, v_pages), shapes unchanged
    """Write token t's K/V to slot `slot_mapping[t]` (= block * block_size + offset), in place.

    One layer's pool, or layer `layer` of a layer-stacked pool: the scatter then touches only the
    written slots of that layer, so a model step that scans over layers never copies the pool.

    Args:
      k_pages: [Hkv, N, Bs, D] one layer's K pool, or [L, Hkv, N, Bs, D] a layer stack written at
        `layer`; donated.
      v_pages: the V pool, shaped like `k_pages`; donated.
      k_new: [T, Hkv, D] the tokens' keys (cast to the pool's dtype).
      v_new: [T, Hkv, D] the tokens' values.
      slot_mapping: i32[T] each token's slot; < 0 (padding) goes to slot 0 of reserved block 0,
        slots past the pool are dropped.
      layer: i32[] the layer of a stacked pool; None with a single layer.

    Returns:
      (k_pages, v_pages), shaped as given: use these, the donated inputs are invalid.
    """
    k_stack, v_stack, layer = layer_stack(k_pages, v_pages, layer)  # [L, Hkv, N, Bs, D] x2, i32[]
    _, num_kv_heads, num_blocks, block_size, head_dim = k_stack.shape
    _check_int32("slot_mapping", slot_mapping, 1)
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    for name, new in (("k_new", k_new), ("v_new", v_new)):
        if new.shape != expected:
            raise ValueError(f"{name}: expected [T, Hkv, D] = {list(expected)}, got {list(new.shape)}")
    slots = jnp.where(slot_mapping < 0, 0, slot_mapping)  # [T]
    blocks, offsets = slots // block_size, slots % block_size  # [T], [T]
    layers = jnp.broadcast_to(layer, blocks.shape)  # [T]
    # Array indices split by a slice index [T, Hkv, D]: exactly the layout of k_new. Out-of-pool
    # slots are a caller bug; drop them rather than clamp onto a live block.
    # 16-bit floats are scattered as their bits (common.as_bits: no float32 copy of the pool); a
    # uint16 pool holds bfloat16 bits (common.kv_dtype).
    k_bits = as_bits(k_stack).at[layers, :, blocks, offsets].set(as_bits(k_new.astype(kv_dtype(k_stack))), mode="drop")
    v_bits = as_bits(v_stack).at[layers, :, blocks, offsets].set(as_bits(v_new.astype(kv_dtype(v_stack))), mode="drop")
    return (from_bits(k_bits, k_stack.dtype).reshape(k_pages.shape),
            from_bits(v_bits, v_stack.dtype).reshape(v_pages.shape))


@functools.partial(jax.jit, donate_argnums=(0, 1))
def copy_blocks(
    k_pages: jax.Array,  # [..., N, Bs, D]
    v_pages: jax.Array,  # [..., N, Bs, D]
    pairs: jax.Array,  # i32[P, 2] (src, dst)
) -> tuple[jax.Array, jax.Array]:
    """Copy block `src` to block `dst` for every pair (copy-on-write), in both pools, in place.

    Args:
      k_pages: [..., N, Bs, D] a K pool (one layer or the layer stack); donated.
      v_pages: the V pool, shaped like `k_pages`; donated.
      pairs: i32[P, 2] (src, dst) block ids. Destinations must be distinct and not sources of other
        pairs (fresh CoW blocks are); padding pairs (0, 0) copy block 0 onto itself, harmlessly.

    Returns:
      (k_pages, v_pages), shaped as given: use these, the donated inputs are invalid.
    """
    _check_pool("k_pages", k_pages)
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages: shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype != jnp.int32:
        raise ValueError(f"pairs: expected int32[P, 2], got {pairs.dtype}{list(pairs.shape)}")
    src, dst = pairs[:, 0], pairs[:, 1]  # [P], [P]
    k_bits, v_bits = as_bits(k_pages), as_bits(v_pages)  # 16-bit floats move as bits (common.as_bits)
    k_bits = k_bits.at[..., dst, :, :].set(k_bits[..., src, :, :])
    v_bits = v_bits.at[..., dst, :, :].set(v_bits[..., src, :, :])
    return from_bits(k_bits, k_pages.dtype), from_bits(v_bits, v_pages.dtype)


@jax.jit
def gather_blocks(
    pages: jax.Array,  # [..., N, Bs, D]
    block_ids: jax.Array,  # i32[P]
) -> jax.Array:  # [..., P, Bs, D]
    """Read whole blocks out of a pool (swap out: device pool -> blocks bound for host memory).

    Args:
      pages: [..., N, Bs, D] a pool (one layer or the layer stack).
      block_ids: i32[P] the blocks to read.

    Returns:
      [..., P, Bs, D] the blocks, in `block_ids` order.
    """
    _check_pool("pages", pages)
    _check_int32("block_ids", block_ids, 1)
    return from_bits(as_bits(pages)[..., block_ids, :, :], pages.dtype)


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_blocks(
    pages: jax.Array,  # [..., N, Bs, D]
    block_ids: jax.Array,  # i32[P]
    blocks: jax.Array,  # [..., P, Bs, D]
) -> jax.Array:  # [..., N, Bs, D]
    """Write whole blocks into a pool in place (swap in: host blocks -> device pool).

    Args:
      pages: [..., N, Bs, D] a pool (one layer or the layer stack); donated.
      block_ids: i32[P] where each block goes; padding entries should point at block 0 (their
        contents land in the reserved block).
      blocks: [..., P, Bs, D] the blocks (cast to the pool's dtype).

    Returns:
      [..., N, Bs, D] the updated pool: use it, the donated input is invalid.
    """
    _check_pool("pages", pages)
    _check_int32("block_ids", block_ids, 1)
    expected = pages.shape[:-3] + (block_ids.shape[0],) + pages.shape[-2:]
    if blocks.shape != expected:
        raise ValueError(f"blocks: expected shape {list(expected)}, got {list(blocks.shape)}")
    bits = as_bits(pages).at[..., block_ids, :, :].set(as_bits(blocks.astype(pages.dtype)))  # bits in, bits out
    return from_bits(bits, pages.dtype)
