"""Stale data never reaches an output: NaN in every unused slot and padded table entry, and a
freed block's old contents under a new owner, for both kernels and both references."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native_cpu
from pallas_kernels import paged_attention as pa
from pallas_kernels import paged_prefill as pp
from tests.pallas_kernels.kernel_cases import INTERPRET, dense_attention, make_case, rel_err

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, GROUP = 8, 2, 64, 4
SCALE = HEAD_DIM ** -0.5


def _decode(case_arrays, q, backend):
    if backend == "reference":
        fn = pa.paged_attention_reference
    elif backend == "xla":
        fn = functools.partial(pa.paged_attention_xla, block_k=16)  # several scan steps
    elif backend == "cpu_native":
        fn = pa.select_impl(backend)
    else:
        fn = pa.select_impl(backend, interpret=INTERPRET, block_k=16, num_splits=3)
    return np.asarray(fn(jnp.asarray(q), *case_arrays, scale=SCALE))


def _prefill(case_arrays, q, starts, backend):
    if backend == "reference":
        fn = pp.paged_prefill_attention_reference
    elif backend == "xla":
        fn = functools.partial(pp.paged_prefill_attention_xla, block_q=4, pages_per_chunk=2)  # several tiles, chunks
    else:
        fn = pp.select_impl(backend, interpret=INTERPRET, block_q=4, block_k=16)
    return np.asarray(fn(jnp.asarray(q), *case_arrays, jnp.asarray(starts), scale=SCALE))


def _cases(stale_tables: bool):
    """The same sequences twice: stale slots NaN vs 0. With `stale_tables`, padded table entries
    point at free NaN blocks instead of block 0."""
    lens = [1, 3, 9, 40, 0]
    cases = [make_case(np.random.default_rng(3), lens, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS,
                       head_dim=HEAD_DIM, max_blocks=6, stale=stale) for stale in (np.nan, 0.0)]
    if stale_tables:
        live = set(cases[0].block_tables[cases[0].block_tables > 0].tolist())
        free = [b for b in range(1, cases[0].k_pages.shape[1]) if b not in live]
        for case in cases:
            for s, n in enumerate(case.context_lens):
                case.block_tables[s, -(-int(n) // BLOCK_SIZE):] = free[s % len(free)]
    return [c.device(jnp.float32) for c in cases]


NATIVE = pytest.param("cpu_native", marks=pytest.mark.skipif(
    not native_cpu.available(), reason=f"native CPU kernel: {native_cpu.unavailable_reason()}"))


@pytest.mark.parametrize("backend", ["pallas", "xla", NATIVE, "reference"])
@pytest.mark.parametrize("stale_tables", [False, True])
def test_decode_ignores_stale_slots(backend, stale_tables):
    nan_case, zero_case = _cases(stale_tables)
    q = np.random.default_rng(0).standard_normal((5, NUM_KV_HEADS * GROUP, HEAD_DIM)).astype(np.float32)
    out_nan, out_zero = _decode(nan_case, q, backend), _decode(zero_case, q, backend)
    assert np.isfinite(out_nan).all()
    np.testing.assert_array_equal(out_nan, out_zero)


@pytest.mark.parametrize("backend", ["pallas", "xla", NATIVE, "reference"])
@pytest.mark.parametrize("stale_tables", [False, True])
def test_prefill_ignores_stale_slots(backend, stale_tables):
    nan_case, zero_case = _cases(stale_tables)
    starts = np.asarray([0, 1, 4, 7, 27, 27], np.int32)  # q_lens 1, 3, 3, 20, 0
    q = np.random.default_rng(0).standard_normal((30, NUM_KV_HEADS * GROUP, HEAD_DIM)).astype(np.float32)
    out_nan, out_zero = _prefill(nan_case, q, starts, backend), _prefill(zero_case, q, starts, backend)
    assert np.isfinite(out_nan).all()
    np.testing.assert_array_equal(out_nan, out_zero)


@pytest.mark.parametrize("backend", ["pallas", "xla", NATIVE])
def test_freed_block_contents_do_not_leak(backend):
    # Sequence A filled blocks 3 and 5 with large values and was freed; sequence B (3 tokens) now
    # owns block 5, whose slots 3.. still hold A's data. B must see only its own 3 tokens.
    rng = np.random.default_rng(5)
    shape = (NUM_KV_HEADS, 8, BLOCK_SIZE, HEAD_DIM)
    k_pages = np.full(shape, 1e3, np.float32)
    v_pages = np.full(shape, -1e3, np.float32)
    k_b = rng.standard_normal((NUM_KV_HEADS, 3, HEAD_DIM)).astype(np.float32)
    v_b = rng.standard_normal((NUM_KV_HEADS, 3, HEAD_DIM)).astype(np.float32)
    k_pages[:, 5, :3], v_pages[:, 5, :3] = k_b, v_b
    arrays = (jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray([[5, 3, 3]], jnp.int32),
              jnp.asarray([3], jnp.int32))
    q = rng.standard_normal((3, NUM_KV_HEADS * GROUP, HEAD_DIM)).astype(np.float32)
    decode = _decode(arrays, q[2:], backend)
    assert rel_err(decode, dense_attention(q[2:], k_b, v_b, np.asarray([2]), SCALE)) < 1e-5
    prefill = _prefill(arrays, q, np.asarray([0, 3], np.int32), backend)
    assert rel_err(prefill, dense_attention(q, k_b, v_b, np.arange(3), SCALE)) < 1e-5


def test_select_impl():
    assert pa.select_impl("xla") is pa.paged_attention_xla
    assert pp.select_impl("xla") is pp.paged_prefill_attention_xla
    assert pa.IMPLS["cpu_native"] is native_cpu.paged_attention_cpu
    assert pp.IMPLS["cpu_native"] is native_cpu.paged_prefill_attention_cpu
    assert pp.select_impl("pallas_triton", block_q=8).keywords == {"interpret": False, "block_q": 8}
    assert pa.select_impl("pallas", interpret=True).keywords == {"interpret": True}
    with pytest.raises(ValueError, match="backend"):
        pa.select_impl("cuda")
