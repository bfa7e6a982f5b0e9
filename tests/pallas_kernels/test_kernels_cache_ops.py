"""write_kv / copy_blocks / gather_blocks / scatter_blocks: round trips, padding only touching the
reserved block 0, layer-stacked pools, and in-place updates (no copy of the pool)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cache_ops

HKV, N, BS, D = 2, 10, 4, 8


def _pool(rng, *lead, num_blocks=N):
    return rng.standard_normal((*lead, HKV, num_blocks, BS, D)).astype(np.float32)


def test_write_kv_round_trip_and_padding():
    rng = np.random.default_rng(0)
    k0, v0 = _pool(rng), _pool(rng)
    slots = np.asarray([5, 6, 37, -1, 13, -1], np.int32)  # -1: padding tokens
    k_new = rng.standard_normal((6, HKV, D)).astype(np.float32)
    v_new = rng.standard_normal((6, HKV, D)).astype(np.float32)
    k, v = cache_ops.write_kv(jnp.asarray(k0), jnp.asarray(v0), jnp.asarray(k_new), jnp.asarray(v_new),
                              jnp.asarray(slots))
    k, v = np.asarray(k), np.asarray(v)
    for t, slot in enumerate(slots):
        if slot >= 0:
            np.testing.assert_array_equal(k[:, slot // BS, slot % BS], k_new[t])
            np.testing.assert_array_equal(v[:, slot // BS, slot % BS], v_new[t])
    # Everything outside the written slots and block 0 is untouched.
    expect_k, expect_v = k0.copy(), v0.copy()
    for t, slot in enumerate(slots[slots >= 0]):
        expect_k[:, slot // BS, slot % BS] = k[:, slot // BS, slot % BS]
        expect_v[:, slot // BS, slot % BS] = v[:, slot // BS, slot % BS]
    np.testing.assert_array_equal(k[:, 1:], expect_k[:, 1:])
    np.testing.assert_array_equal(v[:, 1:], expect_v[:, 1:])


def test_copy_blocks_stacked_pool_with_padding_pairs():
    rng = np.random.default_rng(1)
    k0, v0 = _pool(rng, 3), _pool(rng, 3)  # [L=3, Hkv, N, Bs, D]
    pairs = np.asarray([[3, 5], [4, 7], [0, 0], [0, 0]], np.int32)
    k, v = cache_ops.copy_blocks(jnp.asarray(k0), jnp.asarray(v0), jnp.asarray(pairs))
    expect_k, expect_v = k0.copy(), v0.copy()
    expect_k[..., [5, 7], :, :] = k0[..., [3, 4], :, :]
    expect_v[..., [5, 7], :, :] = v0[..., [3, 4], :, :]
    np.testing.assert_array_equal(np.asarray(k), expect_k)
    np.testing.assert_array_equal(np.asarray(v), expect_v)


def test_swap_round_trip_through_host():
    rng = np.random.default_rng(2)
    device = _pool(rng, 3)
    out_ids = jnp.asarray([2, 9, 4], jnp.int32)
    host_blocks = jax.device_get(cache_ops.gather_blocks(jnp.asarray(device), out_ids))  # swap out
    assert host_blocks.shape == (3, HKV, 3, BS, D)
    target = _pool(rng, 3)
    in_ids = jnp.asarray([6, 1, 8, 0], jnp.int32)  # swap in, padded with block 0
    padded = np.concatenate([host_blocks, np.zeros_like(host_blocks[..., :1, :, :])], axis=-3)
    pages = np.asarray(cache_ops.scatter_blocks(jnp.asarray(target), in_ids, jnp.asarray(padded)))
    np.testing.assert_array_equal(pages[..., [6, 1, 8], :, :], device[..., [2, 9, 4], :, :])
    untouched = [b for b in range(1, N) if b not in (6, 1, 8)]
    np.testing.assert_array_equal(pages[..., untouched, :, :], target[..., untouched, :, :])


def _pointers(*arrays):
    return [a.unsafe_buffer_pointer() for a in arrays]


def test_updates_are_in_place():
    """The donated pool's buffer is reused (pointer unchanged); XLA's temporaries stay far below the pool."""
    rng = np.random.default_rng(3)
    # 64 blocks: a pool copy would dwarf the few copied blocks XLA may stage.
    k, v = jnp.asarray(_pool(rng, 4, num_blocks=64)), jnp.asarray(_pool(rng, 4, num_blocks=64))  # [L, Hkv, N, Bs, D]
    before = _pointers(k, v)
    pairs = jnp.asarray([[1, 2], [0, 0]], jnp.int32)
    k, v = cache_ops.copy_blocks(k, v, pairs)
    assert _pointers(k, v) == before
    k = cache_ops.scatter_blocks(k, jnp.asarray([3], jnp.int32), jnp.ones((4, HKV, 1, BS, D)))
    assert _pointers(k) == before[:1]
    copy_mem = cache_ops.copy_blocks.lower(k, v, pairs).compile().memory_analysis()
    assert copy_mem.temp_size_in_bytes < k.nbytes // 4

    k1, v1 = k[0], v[0]  # one layer [Hkv, N, Bs, D]
    before = _pointers(k1, v1)
    new = jnp.ones((3, HKV, D))
    slots = jnp.asarray([4, -1, 9], jnp.int32)
    k1, v1 = cache_ops.write_kv(k1, v1, new, new, slots)
    assert _pointers(k1, v1) == before
    write_mem = cache_ops.write_kv.lower(k1, v1, new, new, slots).compile().memory_analysis()
    assert write_mem.temp_size_in_bytes < k1.nbytes // 4


def test_shape_errors_name_the_argument():
    k = jnp.zeros((HKV, N, BS, D))
    with pytest.raises(ValueError, match="k_new"):
        cache_ops.write_kv(k, k, jnp.zeros((3, HKV, D + 1)), jnp.zeros((3, HKV, D)), jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="pairs"):
        cache_ops.copy_blocks(jnp.zeros((HKV, N, BS, D)), jnp.zeros((HKV, N, BS, D)), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ValueError, match="blocks"):
        cache_ops.scatter_blocks(jnp.zeros((HKV, N, BS, D)), jnp.zeros(2, jnp.int32), jnp.zeros((HKV, 3, BS, D)))


def test_cache_ops_lower_for_cuda_in_place_at_serving_shapes():
    """OPT-13B's layer-stacked bf16 pool (40 layers x 40 heads x 4,097 blocks of 16): every update
    lowers for CUDA with the pools aliased to its outputs, so XLA writes them in place. (They are
    XLA scatters and gathers, not Triton kernels: there is no Triton IR to compile to cubin.)"""
    from pallas_kernels.targets import A100, abstract_gpu

    pool = jax.ShapeDtypeStruct((40, 40, 4097, 16, 128), jnp.bfloat16)
    new = jax.ShapeDtypeStruct((512, 40, 128), jnp.bfloat16)

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    calls = [(cache_ops.write_kv, (pool, pool, new, new, i32(512), i32()), 2),
             (cache_ops.copy_blocks, (pool, pool, i32(64, 2)), 2),
             (cache_ops.scatter_blocks, (pool, i32(64), jax.ShapeDtypeStruct((40, 40, 64, 16, 128), jnp.bfloat16)), 1)]
    for fn, args, donated in calls:
        with abstract_gpu(A100):
            text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        main = next(line for line in text.splitlines() if "func.func public @main" in line)
        for i in range(donated):
            assert f"%arg{i}: tensor<40x40x4097x16x128xbf16> {{tf.aliasing_output = {i} : i32}}" in main, fn
    with abstract_gpu(A100):
        text = cache_ops.gather_blocks.trace(pool, i32(64)).lower(lowering_platforms=("cuda",)).as_text()
    assert "tensor<40x40x64x16x128xbf16>" in text  # only the gathered blocks leave the pool
