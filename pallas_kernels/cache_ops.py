"""Cache updates on the paged KV pool, in place: write new K/V by slot, copy blocks, swap blocks.

Per-layer pool layout: `[num_kv_heads, num_blocks, block_size, head_dim]`. `copy_blocks`,
`gather_blocks` and `scatter_blocks` accept any pool whose block axis is -3
(`[..., num_blocks, block_size, head_dim]`), so a layer-stacked pool `[L, Hkv, N, Bs, D]` is
updated in one call. The updating functions donate the pool: XLA then performs the scatter in the
pool's own buffer instead of copying the whole pool (tests check the buffer pointer is unchanged).
The caller must use the returned arrays; the donated inputs are invalid afterwards.

Block 0 is the reserved padding target: padded slots (slot < 0) and padding block ids/pairs point
at it, so padding never touches a live block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _check_pool(name: str, pages: jax.Array) -> None:
    if pages.ndim < 3:
        raise ValueError(f"{name}: expected [..., num_blocks, block_size, head_dim], got shape {pages.shape}")


def _check_int32(name: str, arr: jax.Array, ndim: int) -> None:
    if arr.ndim != ndim or arr.dtype != jnp.int32:
        raise ValueError(f"{name}: expected int32 with {ndim} dims, got {arr.dtype}{list(arr.shape)}")


@functools.partial(jax.jit, donate_argnums=(0, 1))
def write_kv(
    k_pages: jax.Array,  # [Hkv, N, Bs, D]
    v_pages: jax.Array,  # [Hkv, N, Bs, D]
    k_new: jax.Array,  # [T, Hkv, D]
    v_new: jax.Array,  # [T, Hkv, D]
    slot_mapping: jax.Array,  # i32[T]
) -> tuple[jax.Array, jax.Array]:  # ([Hkv, N, Bs, D], [Hkv, N, Bs, D])
    """Write token t's K/V to slot `slot_mapping[t]` (= block * block_size + offset) of one layer.

    Slots < 0 (padding) are sent to slot 0 of the reserved block 0. Returns the updated pools.
    """
    if k_pages.ndim != 4 or v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages/v_pages: expected equal [Hkv, N, Bs, D], got {k_pages.shape}, {v_pages.shape}")
    num_kv_heads, num_blocks, block_size, head_dim = k_pages.shape
    _check_int32("slot_mapping", slot_mapping, 1)
    expected = (slot_mapping.shape[0], num_kv_heads, head_dim)
    for name, new in (("k_new", k_new), ("v_new", v_new)):
        if new.shape != expected:
            raise ValueError(f"{name}: expected [T, Hkv, D] = {list(expected)}, got {list(new.shape)}")
    slots = jnp.where(slot_mapping < 0, 0, slot_mapping)  # [T]
    blocks, offsets = slots // block_size, slots % block_size
    # Out-of-pool slots are a caller bug; drop them rather than clamp onto a live block.
    k_pages = k_pages.at[:, blocks, offsets].set(k_new.swapaxes(0, 1).astype(k_pages.dtype), mode="drop")
    v_pages = v_pages.at[:, blocks, offsets].set(v_new.swapaxes(0, 1).astype(v_pages.dtype), mode="drop")
    return k_pages, v_pages


@functools.partial(jax.jit, donate_argnums=(0, 1))
def copy_blocks(
    k_pages: jax.Array,  # [..., N, Bs, D]
    v_pages: jax.Array,  # [..., N, Bs, D]
    pairs: jax.Array,  # i32[P, 2] (src, dst)
) -> tuple[jax.Array, jax.Array]:
    """Copy block `src` to block `dst` for every pair (copy-on-write), in both pools at once.

    Destinations must be distinct and not sources of other pairs (fresh CoW blocks are); padding
    pairs `(0, 0)` copy block 0 onto itself and are harmless.
    """
    _check_pool("k_pages", k_pages)
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages: shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
    if pairs.ndim != 2 or pairs.shape[1] != 2 or pairs.dtype != jnp.int32:
        raise ValueError(f"pairs: expected int32[P, 2], got {pairs.dtype}{list(pairs.shape)}")
    src, dst = pairs[:, 0], pairs[:, 1]  # [P], [P]
    k_pages = k_pages.at[..., dst, :, :].set(k_pages[..., src, :, :])
    v_pages = v_pages.at[..., dst, :, :].set(v_pages[..., src, :, :])
    return k_pages, v_pages


@jax.jit
def gather_blocks(
    pages: jax.Array,  # [..., N, Bs, D]
    block_ids: jax.Array,  # i32[P]
) -> jax.Array:  # [..., P, Bs, D]
    """Read whole blocks out of a pool (swap out: device pool -> blocks bound for host memory)."""
    _check_pool("pages", pages)
    _check_int32("block_ids", block_ids, 1)
    return pages[..., block_ids, :, :]


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_blocks(
    pages: jax.Array,  # [..., N, Bs, D]
    block_ids: jax.Array,  # i32[P]
    blocks: jax.Array,  # [..., P, Bs, D]
) -> jax.Array:  # [..., N, Bs, D]
    """Write whole blocks into a pool in place (swap in: host blocks -> device pool).

    Padding entries should point at block 0 (their contents land in the reserved block).
    """
    _check_pool("pages", pages)
    _check_int32("block_ids", block_ids, 1)
    expected = pages.shape[:-3] + (block_ids.shape[0],) + pages.shape[-2:]
    if blocks.shape != expected:
        raise ValueError(f"blocks: expected shape {list(expected)}, got {list(blocks.shape)}")
    return pages.at[..., block_ids, :, :].set(blocks.astype(pages.dtype))
