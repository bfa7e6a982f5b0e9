"""The Mosaic GPU ragged paged-attention kernel (pallas_kernels.paged_attention_mgpu).

On CPU: Pallas's GPU interpreter runs it (shared memory, TMA copies and barriers simulated; the
two matrix products on the loaded tiles) against the reference on ragged mixes with every stale
slot NaN, and it lowers for CUDA without a GPU (the Mosaic GPU lowering and its Python passes).
On a Hopper GPU (experiments/gpu_check.sh) it compiles and runs against the reference.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention_mgpu as mg
from pallas_kernels import paged_prefill as pp
from tests.pallas_kernels.kernel_cases import make_case, rel_err

NUM_KV_HEADS = 2


def _on_hopper() -> bool:
    device = jax.devices()[0]
    return device.platform == "gpu" and str(getattr(device, "compute_capability", "")).startswith("9")


def _interpret() -> bool:
    """Interpreted, but on a Hopper GPU."""
    return not _on_hopper()


def _ragged_case(block_size, group, head_dim, seed=0):
    """Decodes (one query token), a prompt, a chunk deep in a context and a cached prefix's new
    tokens, a padding sequence, and rows past the last sequence."""
    rng = np.random.default_rng(seed)
    lens = [1, 70, 9, 130, block_size + 5, 0]
    q_lens = [1, 1, 9, 37, 5, 0]
    case = make_case(rng, lens, block_size=block_size, num_kv_heads=NUM_KV_HEADS, head_dim=head_dim,
                     max_blocks=-(-130 // block_size) + 1)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((int(starts[-1]) + 2, NUM_KV_HEADS * group, head_dim)).astype(np.float32)
    return q, case, starts


@pytest.mark.parametrize("block_size,group,head_dim,dtype", [
    (16, 4, 64, jnp.bfloat16),
    pytest.param(8, 2, 128, jnp.float16, marks=pytest.mark.slow),
    pytest.param(64, 8, 64, jnp.bfloat16, marks=pytest.mark.slow),
])
def test_kernel_matches_the_reference_on_a_ragged_mix(block_size, group, head_dim, dtype):
    q, case, starts = _ragged_case(block_size, group, head_dim)
    args = (jnp.asarray(q, dtype), *case.device(dtype), jnp.asarray(starts))
    scale = head_dim ** -0.5
    ref = pp.paged_prefill_attention_reference(*args, scale=scale)
    out = mg.paged_attention_mgpu(*args, scale=scale, interpret=_interpret())
    out32 = np.asarray(out, np.float32)
    assert out.dtype == dtype and np.isfinite(out32).all()
    assert (out32[starts[-1]:] == 0).all()  # rows no sequence owns
    assert rel_err(out32, np.asarray(ref, np.float32)) < 2e-2


def test_it_lowers_for_cuda_without_a_gpu():
    q = jax.ShapeDtypeStruct((77, NUM_KV_HEADS * 4, 128), jnp.bfloat16)
    pool = jax.ShapeDtypeStruct((3, NUM_KV_HEADS, 100, 16, 128), jnp.bfloat16)  # a layer stack
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    fn = jax.jit(functools.partial(mg.paged_attention_mgpu, scale=0.1))
    text = fn.trace(q, pool, pool, i32(5, 40), i32(5), i32(6), i32()).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "triton" not in text


def test_shapes_it_does_not_take_are_refused_naming_its_limits():
    assert mg.supports(jnp.bfloat16, 128, 16, 8) and not mg.supports(jnp.float32, 128, 16, 8)
    assert not mg.supports(jnp.bfloat16, 32, 16, 1) and not mg.supports(jnp.bfloat16, 64, 128, 1)
    q, case, starts = _ragged_case(16, 1, 32)
    with pytest.raises(ValueError, match="head_dim in \\(64, 128\\)"):
        mg.paged_attention_mgpu(jnp.asarray(q, jnp.bfloat16), *case.device(jnp.bfloat16), jnp.asarray(starts),
                                scale=0.1)


def test_the_backend_takes_the_mosaic_kernel_where_it_fits_and_triton_elsewhere():
    attend = pp.select_impl("pallas_mosaic_gpu", interpret=_interpret())
    for dtype, head_dim in ((jnp.bfloat16, 64), (jnp.float32, 32)):  # Mosaic GPU, then Triton
        q, case, starts = _ragged_case(16, 2, head_dim, seed=1)
        args = (jnp.asarray(q, dtype), *case.device(dtype), jnp.asarray(starts))
        ref = pp.paged_prefill_attention_reference(*args, scale=0.2)
        assert rel_err(np.asarray(attend(*args, scale=0.2), np.float32), np.asarray(ref, np.float32)) < 2e-2
    assert pp.select_impl("pallas_mosaic_gpu").func is pp.mosaic_gpu_or_triton
