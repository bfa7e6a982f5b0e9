"""Ragged paged attention for Pallas's Mosaic GPU lowering (Hopper, sm_90a): the successor of the
Triton kernel (`paged_prefill.paged_prefill_attention`), whose lowering JAX deprecates.

The same contract and tile plan as the Triton kernel: every sequence's query rows (decodes, prompt
chunks, verify steps alike) are cut into tiles of `block_q` tokens x the GQA group padded to a
power of two (64 rows: one warpgroup's WGMMA tile), gathered by the wrapper; the grid runs over
(tile, KV head); a program streams its sequence's pages up to the tile's last position, 64 keys a
step, with a flash-style online softmax, so K/V are read once per group and the work follows the
context lengths, not the padding. What Mosaic GPU changes is the data movement: each step's pages
(64 / block_size of them, wherever the block table puts them in the pool) arrive by TMA, one async
copy per page into a swizzled shared-memory tile, each on its own barrier; Q.K^T and P.V run on the
tensor cores (WGMMA) from shared memory, P from registers.

Limits: bfloat16 or float16 pools, head_dim 64 or 128, block_size 8-64 dividing 64, and the padded
GQA group dividing 64. `supports` says whether a shape qualifies; the model falls back to the Triton
kernel otherwise.

What is proven where: CI lowers this kernel for CUDA on a CPU-only machine (`jax.jit(...).lower(
lowering_platforms=("cuda",))`, tests/pallas_kernels/test_mosaic_gpu_lowering.py), which runs
Pallas's Mosaic GPU lowering and the Mosaic GPU dialect's Python passes and emits the custom call;
compiling that module to a cubin and running it needs a Hopper GPU (jaxlib's CUDA plugin), so its
numbers against the reference are checked only where one is lent (experiments/gpu_check.sh runs
the kernel tests on the GPU, this one included).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.common import check_prefill_shapes, next_power_of_2, query_tiles, tokens_from_tiles

ROWS = 64  # query rows of a tile: one warpgroup's WGMMA M
BLOCK_KV = 64  # keys a step
HEAD_DIMS = (64, 128)
DTYPES = (jnp.bfloat16, jnp.float16)


def supports(q_dtype, head_dim: int, block_size: int, group: int) -> bool:
    """Whether the Mosaic GPU kernel takes this shape (else the Triton kernel serves it)."""
    return (jnp.dtype(q_dtype) in map(jnp.dtype, DTYPES) and head_dim in HEAD_DIMS
            and 8 <= block_size <= BLOCK_KV and BLOCK_KV % block_size == 0 and ROWS % next_power_of_2(group) == 0)


def _kernel(layer_ref, meta_ref, tables_ref, q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem, q_barrier,
            k_barriers, v_barriers, *, scale: float, group_pad: int, block_size: int, interpret: bool):
    """One (tile, KV head) program. Refs in global memory: layer i32[1]; meta i32[NT, 2] (context
    length, first query position; length 0 = empty tile); tables i32[NT, M_pad]; q [NT, Hkv, 64, D];
    k, v [L, Hkv, N, Bs, D]; o [NT, Hkv, 64, D]. Shared: q_smem [64, D]; k_smem, v_smem [64, D]."""
    tile, head = lax.axis_index("tile"), lax.axis_index("head")
    head_dim = q_smem.shape[-1]
    pages = BLOCK_KV // block_size
    layer, length, first_pos = layer_ref[0], meta_ref[tile, 0], meta_ref[tile, 1]
    # Causal: the tile needs keys up to its last row's position, never past the context.
    num_keys = jnp.minimum(length, first_pos + ROWS // group_pad)
    plgpu = _plgpu()

    plgpu.copy_gmem_to_smem(q_ref.at[tile, head], q_smem, q_barrier)
    plgpu.barrier_wait(q_barrier)
    # The registers' layouts WGMMA's results have (Pallas's GPU interpreter has no layouts: skipped there).
    wgmma_layout = (lambda x, layout: x) if interpret else plgpu.layout_cast
    iota = (lambda axis: lax.broadcasted_iota(jnp.int32, (ROWS, BLOCK_KV), axis)) if interpret else (
        lambda axis: plgpu.broadcasted_iota(jnp.int32, (ROWS, BLOCK_KV), axis, layout=plgpu.Layout.WGMMA))
    rows, cols = iota(0), iota(1)
    iota_kv = (lambda axis: lax.broadcasted_iota(jnp.int32, (BLOCK_KV, head_dim), axis)) if interpret else (
        lambda axis: plgpu.broadcasted_iota(jnp.int32, (BLOCK_KV, head_dim), axis, layout=plgpu.Layout.WGMMA))

    def matmul(a, b_smem, transpose_b=False):
        """f32[64, N] a @ b (b^T with transpose_b) on the tensor cores: a [64, K] in shared memory or
        registers, b [K, N] in shared memory. (The interpreter has no transposed shared-memory
        view: it multiplies the loaded tiles.)"""
        if interpret:
            a = a if isinstance(a, jax.Array) else a[...]
            b = b_smem[...].T if transpose_b else b_smem[...]
            return jnp.dot(a, b, preferred_element_type=jnp.float32)

        def run(acc_ref):
            plgpu.wgmma(acc_ref, a, b_smem.transpose((1, 0)) if transpose_b else b_smem)
            return acc_ref[...]

        columns = b_smem.shape[0] if transpose_b else b_smem.shape[1]
        return pl.run_scoped(run, plgpu.ACC((ROWS, columns), jnp.float32))

    positions = first_pos + rows // group_pad  # [64, 64] each row's position

    def step(c, carry):
        acc, m_i, l_i = carry
        for p in range(pages):  # the step's pages, wherever the block table puts them
            block = tables_ref[tile, c * pages + p]
            rows_at = pl.ds(p * block_size, block_size)
            plgpu.copy_gmem_to_smem(k_ref.at[layer, head, block], k_smem.at[rows_at], k_barriers.at[p])
            plgpu.copy_gmem_to_smem(v_ref.at[layer, head, block], v_smem.at[rows_at], v_barriers.at[p])
        for p in range(pages):
            plgpu.barrier_wait(k_barriers.at[p])

        s = matmul(q_smem, k_smem, transpose_b=True) * scale  # [64, 64]
        keys = c * BLOCK_KV + cols
        s = jnp.where((keys < length) & (keys <= positions), s, -jnp.inf)
        m_new = jnp.maximum(m_i, s.max(axis=1))
        # A row with no key yet keeps m = -inf: exp(-inf - -inf) would be NaN, so shift by 0 there.
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m_i - shift)
        prob = jnp.exp(s - lax.broadcast_in_dim(shift, s.shape, [0]))
        l_i = l_i * alpha + prob.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        for p in range(pages):
            plgpu.barrier_wait(v_barriers.at[p])

        # Slots past the context may hold anything, NaN included, and 0 x NaN is NaN: the step
        # that reaches past the context zeroes those V rows before P.V reads them.
        @pl.when((c + 1) * BLOCK_KV > length)
        def _():
            key_rows = c * BLOCK_KV + iota_kv(0)  # [64, D]
            v_smem[...] = jnp.where(key_rows < length, v_smem[...], 0).astype(v_smem.dtype)
            plgpu.commit_smem()

        acc = acc + matmul(prob.astype(v_smem.dtype), v_smem)  # [64, D]
        return acc, m_new, l_i

    acc = wgmma_layout(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
    m_i = wgmma_layout(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = wgmma_layout(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc, _, l_i = lax.fori_loop(0, pl.cdiv(num_keys, BLOCK_KV), step, (acc, m_i, l_i))
    acc = acc / lax.broadcast_in_dim(jnp.where(l_i > 0, l_i, 1.0), acc.shape, [0])
    q_smem[...] = acc.astype(q_smem.dtype)  # (Q is no longer read: its buffer stages the output)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q_smem, o_ref.at[tile, head])
    plgpu.wait_smem_to_gmem(0)


def _interpret_params():
    """Pallas's GPU interpreter's parameters (jax names them only in a private module so far)."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


def _plgpu():
    """Pallas's Mosaic GPU module, imported on first use (the kernels never need it elsewhere)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    return plgpu


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def paged_attention_mgpu(
    q: jax.Array,  # [T, Hq, D]
    k_pages: jax.Array,  # [Hkv, N, Bs, D], or [L, Hkv, N, Bs, D] with `layer`
    v_pages: jax.Array,  # same shape as k_pages
    block_tables: jax.Array,  # i32[S, M]
    context_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S + 1]
    layer: jax.Array | int | None = None,  # i32[]: the layer of a stacked pool to read
    *,
    scale: float,
    interpret: bool = False,
) -> jax.Array:  # [T, Hq, D]
    """Mosaic GPU ragged paged attention (see the module docstring); the reference's contract
    (`paged_prefill.paged_prefill_attention_reference`). `interpret`: run it in Pallas's GPU
    interpreter (CPU).

    Raises:
      ValueError when the shapes do not fit (`check_prefill_shapes`) or the kernel does not take
      them (`supports`).
    """
    k_pages, v_pages, layer = check_prefill_shapes(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, layer)
    num_tokens, num_q_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = k_pages.shape
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    if not supports(q.dtype, head_dim, block_size, group) or k_pages.dtype != q.dtype:
        raise ValueError(f"paged_attention_mgpu: takes {[jnp.dtype(d).name for d in DTYPES]} (q and pools alike), "
                         f"head_dim in {HEAD_DIMS}, block_size 8-{BLOCK_KV} dividing {BLOCK_KV} and a padded GQA "
                         f"group dividing {ROWS}; got {q.dtype}/{k_pages.dtype}, head_dim {head_dim}, block_size "
                         f"{block_size}, group {group}")
    plgpu = _plgpu()
    group_pad = next_power_of_2(group)
    block_q = ROWS // group_pad
    pages = BLOCK_KV // block_size
    lens = jnp.minimum(context_lens, max_blocks * block_size)  # i32[S]: a length past the table reads padding
    meta, tables, q_tiles, first_tile = query_tiles(q, block_tables, lens, query_start_loc, num_kv_heads=num_kv_heads,
                                                    block_q=block_q, group_pad=group_pad, pages_per_chunk=pages)
    num_tiles = meta.shape[0]

    # Shared-memory tiles in the layout WGMMA reads: 8 x 64 tiles, 128-byte swizzle (64 bf16 per row).
    transforms = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    o_tiles = plgpu.kernel(
        functools.partial(_kernel, scale=scale, group_pad=group_pad, block_size=block_size, interpret=interpret),
        out_type=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, ROWS, head_dim), q.dtype),
        grid=(num_tiles, num_kv_heads),
        grid_names=("tile", "head"),
        interpret=_interpret_params() if interpret else None,
        scratch_types=[
            plgpu.SMEM((ROWS, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((BLOCK_KV, head_dim), q.dtype, transforms=transforms),
            plgpu.SMEM((BLOCK_KV, head_dim), q.dtype, transforms=transforms),
            plgpu.Barrier(),
            plgpu.Barrier(num_barriers=pages),
            plgpu.Barrier(num_barriers=pages),
        ],
    )(layer.reshape(1), meta, tables, q_tiles, k_pages, v_pages)

    return tokens_from_tiles(o_tiles, query_start_loc, context_lens, first_tile, num_tokens=num_tokens,
                             block_q=block_q, group=group)
