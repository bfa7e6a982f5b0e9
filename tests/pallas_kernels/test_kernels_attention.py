"""Pallas decode and prefill kernels against the references (interpreted on CPU, compiled on GPU), f32 and bf16.

Pools are random permutations of their blocks with every stale slot NaN. Each case batches the
context lengths 1, 3, a block, a block + 1, 513 and the table's maximum, plus a padded sequence.
Knobs are chosen so that every tiled axis (splits, key chunks, query tiles, KV heads) has >= 3 tiles.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels import paged_prefill as pp
from tests.pallas_kernels.kernel_cases import INTERPRET, make_case, rel_err

NUM_KV_HEADS = 3
# (block_size, GQA ratio, head_dim): the default run covers every value; `slow` the full product.
FAST = [(8, 1, 64), (16, 4, 128), (32, 8, 64)]
FULL = [(bs, g, d) for bs in (8, 16, 32) for g in (1, 4, 8) for d in (64, 128)]
SLOW = [pytest.param(*c, marks=pytest.mark.slow) for c in FULL if c not in FAST]


def _lens(block_size: int) -> tuple[list[int], int]:
    max_blocks = -(-513 // block_size) + 1
    return [1, 3, block_size, block_size + 1, 513, max_blocks * block_size, 0], max_blocks


def _decode_inputs(block_size, group, head_dim, seed=0):
    rng = np.random.default_rng(seed)
    lens, max_blocks = _lens(block_size)
    case = make_case(rng, lens, block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                     max_blocks=max_blocks)
    q = rng.standard_normal((len(lens), NUM_KV_HEADS * group, head_dim)).astype(np.float32)
    return q, case


@pytest.mark.parametrize("block_size,group,head_dim", FAST + SLOW)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
def test_decode_kernel_matches_reference(block_size, group, head_dim, dtype, tol):
    q, case = _decode_inputs(block_size, group, head_dim)
    args = (jnp.asarray(q, dtype), *case.device(dtype))
    scale = head_dim ** -0.5
    ref = pa.paged_attention_reference(*args, scale=scale)
    # block_k 16 with 3 splits: >= 3 splits and >= 3 key chunks per split on the long sequences.
    out = pa.paged_attention(*args, scale=scale, block_k=16, num_splits=3, interpret=INTERPRET)
    out32 = np.asarray(out, np.float32)
    assert out.dtype == dtype and np.isfinite(out32).all()
    assert (out32[-1] == 0).all()  # the padded sequence
    assert rel_err(out32, np.asarray(ref, np.float32)) < tol


@pytest.mark.parametrize("block_size,group,head_dim", FAST)
def test_decode_xla_path_matches_reference(block_size, group, head_dim):
    q, case = _decode_inputs(block_size, group, head_dim)
    args = (jnp.asarray(q), *case.device(jnp.float32))
    ref = pa.paged_attention_reference(*args, scale=0.125)
    out = pa.paged_attention_xla(*args, scale=0.125, block_k=32)  # >= 3 scan steps
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out, ref) < 1e-5


def _prefill_inputs(block_size, group, head_dim, seed=1):
    """Sequences covering each prefill use: plain prompts of every test length, a prompt with a
    cached prefix, a chunk in the middle of a long context, one query token, and padding."""
    rng = np.random.default_rng(seed)
    lens, max_blocks = _lens(block_size)
    lens = lens[:-1]
    q_lens = [1, 3, block_size, block_size + 1, 37, 1]  # 513: chunk 476..512; max: one token
    lens += [block_size + 5, 0]
    q_lens += [5, 0]  # a cached one-block prefix + 5 new tokens; an empty padding sequence
    case = make_case(rng, lens, block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                     max_blocks=max_blocks)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(starts[-1]) + 3, NUM_KV_HEADS * group, head_dim)).astype(np.float32)
    return q, case, starts


@pytest.mark.parametrize("block_size,group,head_dim", FAST + SLOW)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 2e-2)])
def test_prefill_kernel_matches_reference(block_size, group, head_dim, dtype, tol):
    q, case, starts = _prefill_inputs(block_size, group, head_dim)
    args = (jnp.asarray(q, dtype), *case.device(dtype), jnp.asarray(starts))
    scale = head_dim ** -0.5
    ref = pp.paged_prefill_attention_reference(*args, scale=scale)
    # block_q * Gp = 16 rows: the 37-token chunk spans >= 3 query tiles; block_k 16: >= 3 key chunks.
    block_q = max(1, 16 // group)
    out = pp.paged_prefill_attention(*args, scale=scale, block_q=block_q, block_k=16, interpret=INTERPRET)
    out32 = np.asarray(out, np.float32)
    assert out.dtype == dtype and np.isfinite(out32).all()
    assert (out32[starts[-1]:] == 0).all()  # rows past the last sequence
    assert rel_err(out32, np.asarray(ref, np.float32)) < tol


@pytest.mark.parametrize("block_size,group,head_dim", FAST)
@pytest.mark.parametrize("block_q,pages_per_chunk", [(4, 2), (32, 8)])
def test_prefill_xla_path_matches_reference(block_size, group, head_dim, block_q, pages_per_chunk):
    q, case, starts = _prefill_inputs(block_size, group, head_dim)
    args = (jnp.asarray(q), *case.device(jnp.float32), jnp.asarray(starts))
    ref = pp.paged_prefill_attention_reference(*args, scale=0.125)
    # block_q 4 cuts the 37-token chunk into 10 tiles; 2 pages per chunk: >= 3 key chunks.
    out = pp.paged_prefill_attention_xla(*args, scale=0.125, block_q=block_q, pages_per_chunk=pages_per_chunk)
    out = np.asarray(out)
    assert np.isfinite(out).all() and (out[starts[-1]:] == 0).all()
    assert rel_err(out, np.asarray(ref)) < 1e-5


def test_contiguous_kernel_matches_paged_reference():
    """The benchmark's non-paged baseline computes the same attention as the paged path."""
    from pallas_kernels.contiguous_attention import (
        contiguous_attention,
        contiguous_attention_reference,
        contiguous_attention_xla,
    )

    q, case = _decode_inputs(16, 4, 64)
    max_len = case.block_tables.shape[1] * 16
    k = np.zeros((len(case.context_lens), NUM_KV_HEADS, max_len, 64), np.float32)
    v = np.full_like(k, np.nan)  # stale tail
    for b, n in enumerate(case.context_lens):
        k[b, :, :n], v[b, :, :n] = case.k_dense[b], case.v_dense[b]
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(case.context_lens))
    paged = np.asarray(pa.paged_attention_reference(jnp.asarray(q), *case.device(jnp.float32), scale=0.125))
    assert rel_err(contiguous_attention_reference(*args, scale=0.125), paged) < 1e-5
    assert rel_err(contiguous_attention_xla(*args, scale=0.125, block_k=32), paged) < 1e-5
    out = contiguous_attention(*args, scale=0.125, block_k=16, num_splits=3, interpret=INTERPRET)
    assert rel_err(out, paged) < 1e-4


@pytest.mark.parametrize("block_q", [None, 8])
def test_prefill_kernel_mixed_prefill_and_decode_batch(block_q):
    """Chunked prefill batches decode tokens (1 query each) with long chunks in one call: 10 decode
    sequences of assorted contexts, a 200-token chunk after a 100-token cached prefix, a 150-token
    prompt. Default knobs (64-row tiles) and small tiles both match the reference."""
    rng = np.random.default_rng(11)
    lens = [1, 2, 15, 16, 17, 33, 64, 100, 250, 301, 300, 150]
    q_lens = [1] * 10 + [200, 150]
    case = make_case(rng, lens, block_size=16, num_kv_heads=2, head_dim=64)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(starts[-1]) + 6, 4, 64)).astype(np.float32)  # 6 padded rows
    args = (jnp.asarray(q), *case.device(jnp.float32), jnp.asarray(starts))
    ref = pp.paged_prefill_attention_reference(*args, scale=0.125)
    out = np.asarray(pp.paged_prefill_attention(*args, scale=0.125, block_q=block_q, interpret=INTERPRET))
    assert np.isfinite(out).all() and (out[starts[-1]:] == 0).all()
    assert rel_err(out, ref) < 1e-4
