"""Every kernel compiles to cubin for A100 (sm_80) and H100 (sm_90) without a GPU: the Triton IR
Pallas emits, compiled by the `triton` package (its bundled ptxas), at serving shapes in bf16.

Asserts no register spills, shared memory within the target's per-block limit, and the launch
model (`pallas_kernels.launch`) an upper bound of the shared memory that is at most one P tile +
1 KB above it. The default run compiles the serving cases and two configurations of each bound
(about a minute on 2 cores); the slow tier the bound's other configurations; the full grid
(`-m compile_grid`) adds every block size, GQA group, head dim, dtype and pool layout.
"""

import functools

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import launch
from pallas_kernels.common import decode_rows
from pallas_kernels.paged_prefill import DEFAULT_TILE_ROWS
from pallas_kernels.targets import A100, H100, SUPPORTED, abstract_gpu
from pallas_kernels.triton_compile import Case, compile_fn, decode_case, prefill_case, serving_cases

pytest.importorskip("triton", reason="the compile tests need the `triton` package (test extra)")

TARGETS = [pytest.param(t, id=t.name) for t in SUPPORTED]
CASES = [pytest.param(c, id=c.label) for c in serving_cases()]


def _check_builds(case: Case, target, *, dots: bool | None = None, rows: int | None = None, block_k: int = 64,
                  num_stages: int = 2):
    builds = compile_fn(case.fn, *case.shapes, target=target)
    assert builds, case.label
    for b in builds:
        assert b.spill_bytes == 0, f"{case.label} on {target.name}: {b}"
        assert b.registers <= target.max_regs_per_thread
        assert b.shared_bytes <= target.smem_per_block, f"{case.label} on {target.name}: {b}"
        if rows is not None:
            itemsize = case.shapes[0].dtype.itemsize
            tile = launch.Tile(rows, case.shapes[0].shape[-1], itemsize, dots=rows > 1 if dots is None else dots)
            model = tile.shared_bytes(block_k=block_k, num_stages=num_stages, num_warps=b.num_warps,
                                      capability=target.capability)
            assert b.shared_bytes <= model <= b.shared_bytes + rows * block_k * itemsize + 1024, (b, model)
    return builds


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", CASES)
def test_serving_shapes_compile_without_spills(case, target):
    _check_builds(case, target)


# The shared-memory model's bounds: one configuration per kernel and target in the default suite,
# the others (each a Triton compile of a few seconds) in the slow tier, which CI also runs.
SLOW = pytest.mark.slow


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("group,block_k,num_stages", [(1, 64, 2), pytest.param(4, 128, 2, marks=SLOW),
                                                      pytest.param(8, 64, 1, marks=SLOW), (4, 64, 3)])
def test_decode_shared_memory_model_bounds_the_compiler(target, group, block_k, num_stages):
    case = decode_case("decode", batch=8, q_heads=8 * group, kv_heads=8, context=1024, block_k=block_k,
                       num_stages=num_stages)
    _check_builds(case, target, rows=decode_rows(group), block_k=block_k, num_stages=num_stages)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("group,block_k", [(1, 64), pytest.param(4, 32, marks=SLOW), pytest.param(8, 64, marks=SLOW)])
def test_prefill_shared_memory_model_bounds_the_compiler(target, group, block_k):
    case = prefill_case("prefill", tokens=256, seqs=4, q_heads=8 * group, kv_heads=8, context=1024, block_k=block_k)
    _check_builds(case, target, rows=DEFAULT_TILE_ROWS, block_k=block_k)


def test_block_k_past_a100_shared_memory_is_refused_and_fits_h100():
    """block_k 256 (bf16, head_dim 128, 2 stages) needs ~209 KB: over an A100 block, under an H100's."""
    case = decode_case("decode_bk256", batch=4, q_heads=32, kv_heads=8, context=1024, block_k=256)
    with pytest.raises(ValueError, match=r"block_k: .*sm_80.*the largest that fits is 128"):
        with abstract_gpu(A100):
            jax.jit(case.fn).trace(*case.shapes)
    [build] = _check_builds(case, H100)
    assert A100.smem_per_block < build.shared_bytes <= H100.smem_per_block


GRID = [(kernel, dtype, group, block_size, head_dim, layers)
        for kernel in ("decode", "prefill") for dtype in (jnp.bfloat16, jnp.float16) for group in (1, 4, 5, 8)
        for block_size in (8, 16, 32) for head_dim in (64, 128) for layers in (None, 4)]


@pytest.mark.compile_grid
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("kernel,dtype,group,block_size,head_dim,layers", GRID)
def test_full_grid_compiles_without_spills(target, kernel, dtype, group, block_size, head_dim, layers):
    make = decode_case if kernel == "decode" else functools.partial(prefill_case, tokens=512, seqs=8)
    extra = {"batch": 16} if kernel == "decode" else {}
    case = make(kernel, q_heads=4 * group, kv_heads=4, context=2048, block_size=block_size, head_dim=head_dim,
                layers=layers, dtype=dtype, **extra)
    _check_builds(case, target)
