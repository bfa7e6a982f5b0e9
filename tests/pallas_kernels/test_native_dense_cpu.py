"""The native CPU dense kernel (pallas_kernels.native_dense_cpu) against `jnp.dot` in float32: odd
shapes (N not a multiple of 16, K odd or not a multiple of 32, M from 1 past two row tiles), bias
or none, both dtypes, every bf16 path this CPU has, and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import native_dense_cpu as nd

pytestmark = pytest.mark.skipif(not nd.available(), reason=f"native dense kernel: {nd.unavailable_reason()}")

# (M, K, N): one row; tails of every kind; exactly one tile; many row tiles with a tail; N < 16.
SHAPES = [(1, 7, 5), (3, 33, 17), (8, 64, 48), (13, 100, 31), (17, 32, 50), (103, 65, 70), (40, 96, 3)]


def _case(m, k, n, dtype, seed=0, bias=True):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    b = jnp.asarray(rng.standard_normal(n), dtype) if bias else None
    return x, w, b


def _reference(x, w, b):
    """layers.linear's semantics in float32: x rounded to W's dtype, exact products, f32 sums, + bias."""
    y = jnp.dot(x.astype(w.dtype).astype(jnp.float32), w.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return y if b is None else y + b.astype(jnp.float32)


def _rel_err(got, want):
    return float(np.abs(np.asarray(got) - np.asarray(want)).max() / np.abs(np.asarray(want)).max())


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_float32_matches_jnp_dot(m, k, n, bias):
    x, w, b = _case(m, k, n, jnp.float32, bias=bias)
    got = nd.matmul(x, nd.pack(w), b, out_features=n)
    assert got.shape == (m, n) and got.dtype == jnp.float32
    assert _rel_err(got, _reference(x, w, b)) < 1e-5  # only the summation order differs


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("path", list(nd.BF16_PATHS))
def test_bfloat16_matches_jnp_dot_on_every_path(m, k, n, path):
    x, w, b = _case(m, k, n, jnp.bfloat16, seed=1)
    got = nd.matmul(x, nd.pack(w), b, out_features=n, bf16_path=path)
    # bf16 x bf16 products are exact in float32: as for float32, only the summation order differs.
    assert _rel_err(got, _reference(x, w, b)) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rows_past_rows_in_use_are_zeros_and_the_rest_unchanged(dtype):
    """A step's padding rows are not computed: the first rows_in_use rows equal the full product
    bit for bit (each row's sums do not depend on the others), the rest are zeros, and counts
    outside [0, M] are clamped. One program serves every count (it is data)."""
    x, w, b = _case(21, 40, 37, dtype, seed=3)
    packed = nd.pack(w)
    full = np.asarray(nd.matmul(x, packed, b, out_features=37))
    for count, kept in [(21, 21), (13, 13), (8, 8), (1, 1), (0, 0), (-4, 0), (99, 21)]:
        got = np.asarray(nd.matmul(x, packed, b, out_features=37, rows_in_use=jnp.int32(count)))
        np.testing.assert_array_equal(got[:kept], full[:kept])
        assert not got[kept:].any()


def test_leading_dims_and_large_values_pass_through():
    x, w, b = _case(6, 40, 20, jnp.float32, seed=2)
    x = x.reshape(2, 3, 40) * 1e20  # products near float32's range: no scaling or rounding inside
    got = nd.matmul(x, nd.pack(w), b, out_features=20)
    assert got.shape == (2, 3, 20)
    assert _rel_err(got.reshape(6, 20), _reference(x.reshape(6, 40), w, b)) < 1e-5


def test_pack_layout():
    w = jnp.arange(5 * 20, dtype=jnp.float32).reshape(5, 20)
    packed = np.asarray(nd.pack(w))  # [P=2, K=5, 16]
    assert packed.shape == (2, 5, 16)
    np.testing.assert_array_equal(packed[1, 3, :4], np.asarray(w)[3, 16:])
    assert not packed[1, :, 4:].any()  # columns past N are zeros
    bits = np.asarray(nd.pack(w.astype(jnp.bfloat16)))  # [P=2, Kp/2=16, 16, 2]
    assert bits.shape == (2, 16, 16, 2) and bits.dtype == np.uint16
    values = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16).astype(jnp.float32)
    assert float(values[0, 1, 7, 1]) == float(w[3, 7])  # pair 1, second of the pair: K row 3
    assert not np.asarray(values[:, 3:]).any()  # K rows past 5 are zeros


def test_bad_input_is_a_clear_error():
    x, w, _ = _case(4, 24, 20, jnp.float32)
    with pytest.raises(ValueError, match="kernel"):
        nd.pack(w.astype(jnp.float16))
    with pytest.raises(ValueError, match="kernel"):
        nd.pack(w[None])
    with pytest.raises(ValueError, match="x: last axis 23"):
        nd.matmul(x[:, :23], nd.pack(w), out_features=20)
    with pytest.raises(ValueError, match="out_features"):
        nd.matmul(x, nd.pack(w), out_features=40)
    with pytest.raises(ValueError, match="bf16_path"):
        nd.matmul(x, nd.pack(w.astype(jnp.bfloat16)), out_features=20, bf16_path="amx2")
