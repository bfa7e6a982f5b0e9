"""Kernels and cache ops on a layer-stacked pool `[L, Hkv, N, Bs, D]` with a layer index: the same
results as on the sliced layer, writes that touch only the written slots of that layer in place,
and a Triton lowering with a traced layer."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import cache_ops
from pallas_kernels import paged_attention as pa
from pallas_kernels import paged_prefill as pp
from pallas_kernels.targets import A100, abstract_gpu
from tests.pallas_kernels.kernel_cases import INTERPRET, make_case, rel_err

NUM_LAYERS, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM, GROUP = 3, 2, 8, 64, 2
SCALE = HEAD_DIM ** -0.5


def _stacked_case(seed=0):
    """Three layers of random NaN-stale pools sharing one set of block tables."""
    cases = [make_case(np.random.default_rng(seed), [1, 9, 40, 0], block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                       head_dim=HEAD_DIM, max_blocks=6) for _ in range(NUM_LAYERS)]
    rng = np.random.default_rng(seed + 1)
    k = np.stack([c.k_pages + rng.standard_normal(c.k_pages.shape).astype(np.float32) for c in cases])
    v = np.stack([c.v_pages + rng.standard_normal(c.v_pages.shape).astype(np.float32) for c in cases])
    return jnp.asarray(k), jnp.asarray(v), jnp.asarray(cases[0].block_tables), jnp.asarray(cases[0].context_lens)


DECODE = {
    "reference": pa.paged_attention_reference,
    "xla": functools.partial(pa.paged_attention_xla, block_k=16),
    "pallas": functools.partial(pa.paged_attention, block_k=16, num_splits=2, interpret=INTERPRET),
}
PREFILL = {
    "reference": pp.paged_prefill_attention_reference,
    "pallas": functools.partial(pp.paged_prefill_attention, block_q=8, block_k=16, interpret=INTERPRET),
}


@pytest.mark.parametrize("impl", list(DECODE))
def test_decode_reads_the_indexed_layer(impl):
    k, v, tables, lens = _stacked_case()
    q = jnp.asarray(np.random.default_rng(2).standard_normal((4, NUM_KV_HEADS * GROUP, HEAD_DIM)), jnp.float32)
    fn = jax.jit(functools.partial(DECODE[impl], scale=SCALE))
    for layer in range(NUM_LAYERS):
        stacked = fn(q, k, v, tables, lens, jnp.int32(layer))  # the layer is traced: one compile
        sliced = DECODE[impl](q, k[layer], v[layer], tables, lens, scale=SCALE)
        assert np.isfinite(np.asarray(stacked)).all()
        assert rel_err(stacked[:3], sliced[:3]) < 1e-6


@pytest.mark.parametrize("impl", list(PREFILL))
def test_prefill_reads_the_indexed_layer(impl):
    k, v, tables, lens = _stacked_case()
    starts = jnp.asarray([0, 1, 6, 18, 18], jnp.int32)  # query lengths 1, 5, 12 and a padded sequence
    q = jnp.asarray(np.random.default_rng(3).standard_normal((20, NUM_KV_HEADS * GROUP, HEAD_DIM)), jnp.float32)
    for layer in range(NUM_LAYERS):
        stacked = PREFILL[impl](q, k, v, tables, lens, starts, jnp.int32(layer), scale=SCALE)
        sliced = PREFILL[impl](q, k[layer], v[layer], tables, lens, starts, scale=SCALE)
        assert np.isfinite(np.asarray(stacked)).all()
        assert rel_err(stacked[:18], sliced[:18]) < 1e-6


def test_write_kv_touches_only_the_indexed_layer_in_place():
    rng = np.random.default_rng(4)
    shape = (NUM_LAYERS, NUM_KV_HEADS, 64, BLOCK_SIZE, HEAD_DIM)  # [L, Hkv, N, Bs, D]
    k0, v0 = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    k, v = jnp.asarray(k0), jnp.asarray(v0)
    slots = jnp.asarray([13, -1, 100], jnp.int32)  # -1: padding -> block 0
    k_new = jnp.asarray(rng.standard_normal((3, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((3, NUM_KV_HEADS, HEAD_DIM)), jnp.float32)
    before = [k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()]
    k, v = cache_ops.write_kv(k, v, k_new, v_new, slots, 1)
    assert [k.unsafe_buffer_pointer(), v.unsafe_buffer_pointer()] == before
    expect_k, expect_v = k0.copy(), v0.copy()
    for t, slot in ((0, 13), (1, 0), (2, 100)):
        expect_k[1, :, slot // BLOCK_SIZE, slot % BLOCK_SIZE] = k_new[t]
        expect_v[1, :, slot // BLOCK_SIZE, slot % BLOCK_SIZE] = v_new[t]
    np.testing.assert_array_equal(np.asarray(k), expect_k)
    np.testing.assert_array_equal(np.asarray(v), expect_v)
    # Scratch of the compiled scatter is a few slots, not a layer (one layer here is 64 KiB per pool).
    mem = cache_ops.write_kv.lower(k, v, k_new, v_new, slots, jnp.int32(2)).compile().memory_analysis()
    assert mem.temp_size_in_bytes < k.nbytes // NUM_LAYERS // 16
    assert mem.alias_size_in_bytes == k.nbytes + v.nbytes


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_stacked_pool_lowers_to_triton(kernel):
    pool = jax.ShapeDtypeStruct((5, 3, 100, 16, 128), jnp.bfloat16)  # [L, Hkv, N, Bs, D]
    q = jax.ShapeDtypeStruct((7, 12, 128), jnp.bfloat16)
    if kernel == "decode":
        fn = functools.partial(pa.paged_attention, scale=0.1)
        args = (q, pool, pool, _i32(7, 40), _i32(7), _i32())
    else:
        fn = functools.partial(pp.paged_prefill_attention, scale=0.1)
        args = (q, pool, pool, _i32(4, 40), _i32(4), _i32(5), _i32())
    with abstract_gpu(A100):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    assert "tensor<3x100x16x128xbf16>" not in text  # no layer is sliced out of the pool


def test_layer_argument_errors_name_it():
    pool = jnp.zeros((2, NUM_KV_HEADS, 4, BLOCK_SIZE, HEAD_DIM))
    q, tables, lens = jnp.zeros((1, 4, HEAD_DIM)), jnp.zeros((1, 1), jnp.int32), jnp.zeros(1, jnp.int32)
    with pytest.raises(ValueError, match="k_pages: without a layer index"):
        pa.paged_attention_xla(q, pool, pool, tables, lens, scale=1.0)
    with pytest.raises(ValueError, match="k_pages: with a layer index"):
        pa.paged_attention_xla(q, pool[0], pool[0], tables, lens, 0, scale=1.0)
    with pytest.raises(ValueError, match="layer: expected an integer scalar"):
        pp.paged_prefill_attention_reference(q, pool, pool, tables, lens, jnp.zeros(2, jnp.int32),
                                             jnp.zeros(2, jnp.int32), scale=1.0)
    with pytest.raises(ValueError, match="layer: expected an integer scalar"):
        cache_ops.write_kv(pool, pool, jnp.zeros((1, NUM_KV_HEADS, HEAD_DIM)), jnp.zeros((1, NUM_KV_HEADS, HEAD_DIM)),
                           jnp.zeros(1, jnp.int32), 0.5)
