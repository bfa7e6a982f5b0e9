"""The plain-jnp references (the XLA path) against hand-computed cases and a float64 oracle."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import token_positions
from pallas_kernels.paged_attention import paged_attention_reference
from pallas_kernels.paged_prefill import paged_prefill_attention_reference
from tests.pallas_kernels.kernel_cases import dense_attention, make_case, rel_err

NAN = np.nan


def _hand_pool():
    """One KV head, D = 2, Bs = 2, 3 blocks. The sequence's tokens 0, 1 sit in block 2 and token 2
    in block 1 slot 0; block 0 and block 1 slot 1 are stale (NaN)."""
    k = np.full((1, 3, 2, 2), NAN, np.float32)
    v = np.full((1, 3, 2, 2), NAN, np.float32)
    k[0, 2] = [[1, 0], [0, 1]]
    v[0, 2] = [[1, 0], [0, 2]]
    k[0, 1, 0] = [1, 1]
    v[0, 1, 0] = [3, 3]
    return jnp.asarray(k), jnp.asarray(v)


def test_decode_reference_hand_case():
    # q . k = [1, 0, 1]; with scale ln 2 the weights are [2, 1, 2] / 5, so
    # out = 0.4 [1, 0] + 0.2 [0, 2] + 0.4 [3, 3] = [1.6, 1.6]. Sequence 1 is padding (length 0).
    k, v = _hand_pool()
    q = jnp.asarray([[[1.0, 0.0]], [[5.0, 5.0]]])  # [B=2, Hq=1, D=2]
    tables = jnp.asarray([[2, 1], [0, 0]], jnp.int32)
    out = paged_attention_reference(q, k, v, tables, jnp.asarray([3, 0], jnp.int32), scale=math.log(2))
    np.testing.assert_allclose(np.asarray(out), [[[1.6, 1.6]], [[0.0, 0.0]]], rtol=1e-6)


def test_prefill_reference_hand_case():
    # Sequence 0 has context 3 and its last 2 tokens as queries (positions 1 and 2):
    # row 0 sees keys 0..1 -> weights [2, 1] / 3 -> [2/3, 2/3]; row 1 as the decode case.
    # Sequence 1 is empty padding; row 2 belongs to no sequence and must be 0.
    k, v = _hand_pool()
    q = jnp.asarray([[[1.0, 0.0]], [[1.0, 0.0]], [[7.0, 7.0]]])  # [T=3, Hq=1, D=2]
    tables = jnp.asarray([[2, 1], [0, 0]], jnp.int32)
    out = paged_prefill_attention_reference(q, k, v, tables, jnp.asarray([3, 0], jnp.int32),
                                            jnp.asarray([0, 2, 2], jnp.int32), scale=math.log(2))
    np.testing.assert_allclose(np.asarray(out), [[[2 / 3, 2 / 3]], [[1.6, 1.6]], [[0.0, 0.0]]], rtol=1e-6)


def test_token_positions_ragged_with_empty_ranges():
    # Sequences: 2 queries of context 5, empty, 1 query of context 4; rows 3..4 are padding.
    seq_ids, positions, valid = token_positions(jnp.asarray([0, 2, 2, 3], jnp.int32),
                                                jnp.asarray([5, 0, 4], jnp.int32), 5)
    assert np.asarray(valid).tolist() == [True, True, True, False, False]
    assert np.asarray(seq_ids)[:3].tolist() == [0, 0, 2]
    assert np.asarray(positions)[:3].tolist() == [3, 4, 3]


@pytest.mark.parametrize("group", [1, 4])
def test_decode_reference_matches_oracle(group):
    rng = np.random.default_rng(group)
    case = make_case(rng, [1, 7, 16, 17, 40], block_size=8, num_kv_heads=2, head_dim=16)
    q = rng.standard_normal((5, 2 * group, 16)).astype(np.float32)
    out = paged_attention_reference(jnp.asarray(q), *case.device(jnp.float32), scale=0.25)
    assert np.isfinite(np.asarray(out)).all()
    for b, n in enumerate(case.context_lens):
        ref = dense_attention(q[b:b + 1], case.k_dense[b], case.v_dense[b], np.asarray([n - 1]), 0.25)
        assert rel_err(out[b:b + 1], ref) < 1e-5


def test_prefill_reference_matches_oracle():
    rng = np.random.default_rng(7)
    lens, q_lens = [9, 20, 4], [9, 5, 1]  # plain prompt, cached prefix + chunk, one token
    case = make_case(rng, lens, block_size=4, num_kv_heads=2, head_dim=16)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((starts[-1] + 2, 4, 16)).astype(np.float32)  # 2 padded rows
    out = np.asarray(paged_prefill_attention_reference(jnp.asarray(q), *case.device(jnp.float32),
                                                       jnp.asarray(starts), scale=0.25))
    for s, (n, ql) in enumerate(zip(lens, q_lens)):
        rows = slice(starts[s], starts[s + 1])
        ref = dense_attention(q[rows], case.k_dense[s], case.v_dense[s], np.arange(n - ql, n), 0.25)
        assert rel_err(out[rows], ref) < 1e-5
    assert (out[starts[-1]:] == 0).all()
