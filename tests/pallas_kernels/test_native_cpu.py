"""The native CPU decode kernel (pallas_kernels.native_cpu) against the plain-jnp reference:
float32 and bfloat16-bits pools, GQA, a layer stack, empty and partial sequences, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native_cpu
from pallas_kernels import paged_attention as pa
from pallas_kernels import paged_prefill as pp
from pallas_kernels.backends import resolve_backend
from tests.pallas_kernels.kernel_cases import make_case, rel_err

pytestmark = pytest.mark.skipif(not native_cpu.available(),
                                reason=f"native CPU kernel: {native_cpu.unavailable_reason()}")

BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 16, 2, 64, 3
LENS = [0, 1, 15, 16, 17, 70, 33]  # empty, one token, block edges, several blocks


def _stacked_case(group: int, seed: int = 0):
    """A [L, Hkv, N, Bs, D] pool (every layer different, stale slots NaN) and q [B, Hkv * group, D]."""
    rng = np.random.default_rng(seed)
    cases = [make_case(rng, LENS, block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                       max_blocks=6) for _ in range(NUM_LAYERS)]
    # One set of tables for all layers: take layer 0's, and place every layer's sequences there.
    tables, lens = cases[0].block_tables, cases[0].context_lens
    shape = (NUM_LAYERS,) + cases[0].k_pages.shape
    k, v = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    for layer, case in enumerate(cases):
        for s, n in enumerate(lens):
            for t in range(int(n)):
                k[layer, :, tables[s, t // BLOCK_SIZE], t % BLOCK_SIZE] = case.k_dense[s][:, t]
                v[layer, :, tables[s, t // BLOCK_SIZE], t % BLOCK_SIZE] = case.v_dense[s][:, t]
    q = rng.standard_normal((len(LENS), NUM_KV_HEADS * group, HEAD_DIM)).astype(np.float32)
    return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(tables), jnp.asarray(lens)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("layer", [0, 2])
def test_float32_matches_reference(group, layer):
    q, k, v, tables, lens = _stacked_case(group)
    out = np.asarray(native_cpu.paged_attention_cpu(q, k, v, tables, lens, layer, scale=HEAD_DIM ** -0.5))
    want = np.asarray(pa.paged_attention_reference(q, jnp.nan_to_num(k), jnp.nan_to_num(v), tables, lens, layer,
                                                   scale=HEAD_DIM ** -0.5))
    assert np.isfinite(out).all()  # NaN in every stale slot never reaches an output
    assert rel_err(out, want) < 1e-5
    assert not out[0].any()  # the empty sequence gives zeros


@pytest.mark.parametrize("group", [1, 2])
def test_bfloat16_bits_pool_matches_reference_on_the_bf16_pool(group):
    q, k, v, tables, lens = _stacked_case(group, seed=1)
    k16, v16 = jnp.nan_to_num(k).astype(jnp.bfloat16), jnp.nan_to_num(v).astype(jnp.bfloat16)
    bits = [jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (k16, v16)]
    out = native_cpu.paged_attention_cpu(q, *bits, tables, lens, 1, scale=0.125)
    want = pa.paged_attention_reference(q, k16, v16, tables, lens, 1, scale=0.125)
    # Both read the same bf16 values and accumulate in float32: only the summation order differs.
    assert rel_err(np.asarray(out), np.asarray(want)) < 1e-5
    # A bf16-typed pool is bitcast to its bits by the wrapper: the same result.
    np.testing.assert_array_equal(np.asarray(native_cpu.paged_attention_cpu(q, k16, v16, tables, lens, 1,
                                                                            scale=0.125)), np.asarray(out))


def test_single_layer_pool_and_bf16_query():
    q, k, v, tables, lens = _stacked_case(2)
    k0, v0 = jnp.nan_to_num(k[1]), jnp.nan_to_num(v[1])
    out = native_cpu.paged_attention_cpu(q.astype(jnp.bfloat16), k0, v0, tables, lens, scale=0.125)
    assert out.dtype == jnp.bfloat16
    want = pa.paged_attention_reference(q.astype(jnp.bfloat16), k0, v0, tables, lens, scale=0.125)
    assert rel_err(np.asarray(out, np.float32), np.asarray(want, np.float32)) < 1e-2


def test_out_of_range_block_ids_stay_inside_the_pool_and_lengths_are_clamped():
    q, k, v, tables, lens = _stacked_case(1)
    k, v = jnp.nan_to_num(k), jnp.nan_to_num(v)
    bad_tables = tables.at[5, 1].set(10 ** 6).at[6, 0].set(-3)  # past the pool, negative: clamped to a block
    long_lens = lens.at[3].set(10 ** 6)  # past the table: read as M * Bs tokens, as the XLA path does
    out = np.asarray(native_cpu.paged_attention_cpu(q, k, v, bad_tables, long_lens, 0, scale=0.125))
    clamped = jnp.minimum(long_lens, tables.shape[1] * BLOCK_SIZE)
    want = np.asarray(pa.paged_attention_reference(q, k, v, tables, clamped, 0, scale=0.125))
    assert np.isfinite(out).all()
    assert rel_err(out[:5], want[:5]) < 1e-5  # the sequences with valid tables


def test_bad_input_names_the_argument():
    q, k, v, tables, lens = _stacked_case(1)
    with pytest.raises(ValueError, match="k_pages"):
        native_cpu.paged_attention_cpu(q, k.astype(jnp.float16), v.astype(jnp.float16), tables, lens, 0, scale=1.0)
    with pytest.raises(ValueError, match="block_tables"):
        native_cpu.paged_attention_cpu(q, k, v, tables.astype(jnp.float32), lens, 0, scale=1.0)
    with pytest.raises(ValueError, match="context_lens"):
        native_cpu.paged_attention_cpu(q, k, v, tables, lens[:-1], 0, scale=1.0)


def test_backend_name_resolves_and_is_cpu_default():
    assert resolve_backend("cpu_native") == "cpu_native"
    assert resolve_backend("auto") == "cpu_native"
    assert pa.select_impl("cpu_native") is native_cpu.paged_attention_cpu
    assert pp.select_impl("cpu_native") is native_cpu.paged_prefill_attention_cpu


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefill_matches_reference(group, dtype):
    """Ragged query chunks: whole prompts, a chunk after a cached prefix, one-token (decode) rows,
    an empty sequence and padded rows, over NaN stale slots."""
    q, k, v, tables, lens = _stacked_case(group, seed=2)
    if dtype == jnp.bfloat16:
        k, v = (jnp.nan_to_num(x).astype(jnp.bfloat16) for x in (k, v))
    q_lens = np.asarray([0, 1, 15, 3, 17, 70, 1])  # <= LENS; 3 and 1 leave a cached prefix
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    num_tokens = int(q_lens.sum()) + 5  # + padded rows
    qt = jnp.asarray(np.random.default_rng(4).standard_normal((num_tokens,) + q.shape[1:]), jnp.float32)
    pools = [jax.lax.bitcast_convert_type(x, jnp.uint16) if dtype == jnp.bfloat16 else x for x in (k, v)]
    out = np.asarray(native_cpu.paged_prefill_attention_cpu(qt, *pools, tables, lens, starts, 2, scale=0.125))
    want = np.asarray(pp.paged_prefill_attention_reference(qt, jnp.nan_to_num(k), jnp.nan_to_num(v), tables, lens,
                                                           starts, 2, scale=0.125))
    assert np.isfinite(out).all()
    assert rel_err(out, want) < 1e-5
    assert not out[int(q_lens.sum()):].any()  # rows owned by no sequence


@pytest.mark.parametrize("head_dim, block_size", [(32, 8), (48, 16), (128, 32)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("q_scale", [1.0, 40.0])
def test_vector_and_scalar_paths_match_the_reference(head_dim, block_size, dtype, q_scale):
    """Head dims 32 and 128 take the vector path, 48 the scalar one; pages narrower than a vector
    (8 slots), rows of a verify step (a few causal rows after a long context), and scores spread
    so wide (q x 40) that most exps underflow to 0."""
    rng = np.random.default_rng(5)
    lens = [1, 7, 40, 251, 9]
    case = make_case(rng, lens, block_size=block_size, num_kv_heads=2, head_dim=head_dim)
    k, v, tables, context_lens = case.device(jnp.float32)
    if dtype == jnp.bfloat16:
        k, v = (jnp.nan_to_num(x).astype(jnp.bfloat16) for x in (k, v))
    q_lens = np.asarray([1, 7, 3, 5, 0])  # a decode, a whole prompt, then verify-like rows
    starts = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    q = q_scale * rng.standard_normal((int(q_lens.sum()) + 2, 6, head_dim)).astype(np.float32)
    pools = [jax.lax.bitcast_convert_type(x, jnp.uint16) if dtype == jnp.bfloat16 else x for x in (k, v)]
    out = np.asarray(native_cpu.paged_prefill_attention_cpu(jnp.asarray(q), *pools, tables, context_lens, starts,
                                                            scale=head_dim ** -0.5))
    want = np.asarray(pp.paged_prefill_attention_reference(jnp.asarray(q), jnp.nan_to_num(k), jnp.nan_to_num(v),
                                                           tables, context_lens, starts, scale=head_dim ** -0.5))
    assert np.isfinite(out).all()
    assert rel_err(out, want) < 1e-5
    assert not out[int(q_lens.sum()):].any()
