"""The kernels lower through Pallas's Triton backend for CUDA (run on CPU: lowering needs no GPU,
only an abstract GPU device on newer jax), over the whole test grid and the benchmark's shapes;
knobs that break Triton's rules are rejected."""

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels import paged_prefill as pp
from pallas_kernels.targets import A100, abstract_gpu

GRID = [(bs, g, d, dt) for bs in (8, 16, 32, 64) for g in (1, 4, 8) for d in (64, 128)
        for dt in (jnp.float32, jnp.bfloat16, jnp.float16)]
NUM_KV_HEADS, NUM_BLOCKS, MAX_BLOCKS, BATCH = 3, 100, 40, 5


def _lower_for_cuda(fn, *shapes):
    with abstract_gpu(A100):
        text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text  # the Triton custom call, not Mosaic GPU
    return text


def _pool(bs, d, dt):
    return jax.ShapeDtypeStruct((NUM_KV_HEADS, NUM_BLOCKS, bs, d), dt)


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


@pytest.mark.parametrize("block_size,group,head_dim,dtype", GRID)
def test_decode_lowers_to_triton(block_size, group, head_dim, dtype):
    q = jax.ShapeDtypeStruct((BATCH, NUM_KV_HEADS * group, head_dim), dtype)
    fn = functools.partial(pa.paged_attention, scale=0.1, block_k=16, num_splits=3)
    _lower_for_cuda(fn, q, _pool(block_size, head_dim, dtype), _pool(block_size, head_dim, dtype),
                    _i32(BATCH, MAX_BLOCKS), _i32(BATCH))


@pytest.mark.parametrize("block_size,group,head_dim,dtype", GRID)
def test_prefill_lowers_to_triton(block_size, group, head_dim, dtype):
    q = jax.ShapeDtypeStruct((77, NUM_KV_HEADS * group, head_dim), dtype)
    fn = functools.partial(pp.paged_prefill_attention, scale=0.1, block_q=max(1, 16 // group), block_k=16)
    _lower_for_cuda(fn, q, _pool(block_size, head_dim, dtype), _pool(block_size, head_dim, dtype),
                    _i32(BATCH, MAX_BLOCKS), _i32(BATCH), _i32(BATCH + 1))


def test_contiguous_baseline_lowers_to_triton():
    from pallas_kernels.contiguous_attention import contiguous_attention

    q = jax.ShapeDtypeStruct((BATCH, 40, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((BATCH, 40, 2048, 128), jnp.bfloat16)
    _lower_for_cuda(functools.partial(contiguous_attention, scale=0.1), q, cache, cache, _i32(BATCH))


def test_default_knobs_lower_with_odd_group():
    # A GQA group of 5 (e.g. 40 query heads over 8 KV heads) is padded to a power of two.
    q = jax.ShapeDtypeStruct((BATCH, 40, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((8, NUM_BLOCKS, 16, 128), jnp.bfloat16)
    _lower_for_cuda(functools.partial(pa.paged_attention, scale=0.1), q, pool, pool, _i32(BATCH, MAX_BLOCKS),
                    _i32(BATCH))
    _lower_for_cuda(functools.partial(pp.paged_prefill_attention, scale=0.1), q, pool, pool,
                    _i32(BATCH, MAX_BLOCKS), _i32(BATCH), _i32(BATCH + 1))


@pytest.mark.parametrize("knobs,match", [
    ({"block_k": 8}, "block_k"), ({"block_k": 48}, "block_k"), ({"num_splits": 0}, "num_splits"),
])
def test_decode_rejects_bad_knobs(knobs, match):
    q, pool = jnp.zeros((2, 4, 64)), jnp.zeros((2, 9, 8, 64))
    with pytest.raises(ValueError, match=match):
        pa.paged_attention(q, pool, pool, jnp.zeros((2, 3), jnp.int32), jnp.zeros(2, jnp.int32), scale=1.0, **knobs)


def test_rejects_bad_shapes():
    pool = jnp.zeros((2, 9, 8, 48))
    with pytest.raises(ValueError, match="head_dim"):
        pa.paged_attention(jnp.zeros((2, 4, 48)), pool, pool, jnp.zeros((2, 3), jnp.int32),
                           jnp.zeros(2, jnp.int32), scale=1.0)
    pool = jnp.zeros((2, 9, 8, 64))
    with pytest.raises(ValueError, match="num_kv_heads"):
        pa.paged_attention_reference(jnp.zeros((2, 3, 64)), pool, pool, jnp.zeros((2, 3), jnp.int32),
                                     jnp.zeros(2, jnp.int32), scale=1.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        pp.paged_prefill_attention(jnp.zeros((5, 4, 64)), pool, pool, jnp.zeros((2, 3), jnp.int32),
                                   jnp.zeros(2, jnp.int32), jnp.zeros(2, jnp.int32), scale=1.0)
    with pytest.raises(ValueError, match="block_q"):  # 4 tokens x group 2 = 8 rows < 16
        pp.paged_prefill_attention(jnp.zeros((5, 4, 64)), pool, pool, jnp.zeros((2, 3), jnp.int32),
                                   jnp.zeros(2, jnp.int32), jnp.zeros(3, jnp.int32), scale=1.0, block_q=4)
