"""Launch shapes are chosen per call and target (no `triton` package needed: the grid and warps are
read from the lowered Triton kernels): split-K fills >= 2 waves of an A100 / H100, warps follow
the tile, one-row decode carries no padded rows, and limit violations name the knob."""

import math

import jax
import pytest

from pallas_kernels import launch, native_cpu
from pallas_kernels.backend_names import BACKEND_NAMES
from pallas_kernels.backends import BACKENDS, resolve_backend
from pallas_kernels.targets import A100, H100, abstract_gpu, current_target, target_for_capability
from pallas_kernels.triton_compile import decode_case, lower_triton, prefill_case


@pytest.mark.parametrize("target", [A100, H100], ids=lambda t: t.name)
@pytest.mark.parametrize("batch,q_heads,kv_heads", [(1, 40, 40), (8, 8, 8), (8, 32, 8), (32, 40, 40), (32, 32, 8)])
def test_decode_splits_fill_two_waves(target, batch, q_heads, kv_heads):
    context, block_k = 2048, 64
    case = decode_case("decode", batch=batch, q_heads=q_heads, kv_heads=kv_heads, context=context)
    [kernel] = lower_triton(case.fn, *case.shapes, target=target)
    programs = math.prod(kernel.grid)
    splits = programs // (batch * kv_heads)
    rows = 1 if q_heads == kv_heads else 16
    tile = launch.Tile(rows, 128, 2, dots=rows > 1)
    smem = tile.shared_bytes(block_k=block_k, num_stages=2, num_warps=kernel.num_warps, capability=target.capability)
    slots = target.num_sms * launch.resident_programs(target, smem=smem, num_warps=kernel.num_warps)
    num_chunks = context // block_k
    assert programs >= launch.MIN_WAVES * slots or splits == num_chunks, (kernel.grid, slots)
    # ... and not more than needed: halving the splits would miss two waves (or splits are already 1).
    assert splits == 1 or (splits // 2) * batch * kv_heads < launch.MIN_WAVES * slots


def test_h100_gets_more_splits_than_a100():
    case = decode_case("decode", batch=8, q_heads=32, kv_heads=8, context=2048)
    [a100] = lower_triton(case.fn, *case.shapes, target=A100)
    [h100] = lower_triton(case.fn, *case.shapes, target=H100)
    a100_splits, h100_splits = math.prod(a100.grid) // 64, math.prod(h100.grid) // 64
    assert h100_splits > a100_splits > 4  # JAX's own kernel defaults to 16; ours was fixed at 4


def test_warps_follow_the_tile():
    decode = decode_case("decode", batch=8, q_heads=32, kv_heads=8, context=2048)
    [kernel] = lower_triton(decode.fn, *decode.shapes, target=A100)
    assert kernel.num_warps == 4  # 16-row tile
    prefill = prefill_case("prefill", tokens=512, seqs=1, q_heads=32, kv_heads=8, context=2048)
    [kernel] = lower_triton(prefill.fn, *prefill.shapes, target=A100)
    assert kernel.num_warps == 8  # 64-row tile: 4 warps sit at 255 registers (compile table)
    big = decode_case("decode", batch=8, q_heads=32, kv_heads=8, context=2048, block_k=256)
    [kernel] = lower_triton(big.fn, *big.shapes, target=H100)
    assert kernel.num_warps > 4  # a 256-key chunk spills at 4 warps


def test_one_query_head_per_kv_head_is_not_padded():
    """GQA 1 (OPT): the program holds one query row; partials are [.., 1, D], not 16 padded rows."""
    case = decode_case("decode", batch=4, q_heads=8, kv_heads=8, context=256)
    with abstract_gpu(A100):
        text = jax.jit(case.fn).trace(*case.shapes).lower(lowering_platforms=("cuda",)).as_text()
    splits = math.prod(lower_triton(case.fn, *case.shapes, target=A100)[0].grid) // (4 * 8)
    assert f"tensor<4x8x{splits}x1x128xf32>" in text
    assert "x16x128xf32>" not in text


def test_knobs_over_the_target_limits_name_the_knob():
    case = decode_case("decode", batch=4, q_heads=32, kv_heads=8, context=1024, block_k=256)
    with abstract_gpu(A100), pytest.raises(ValueError, match=r"^block_k: .*166,912 B per block"):
        jax.jit(case.fn).trace(*case.shapes)
    with abstract_gpu(H100):
        jax.jit(case.fn).trace(*case.shapes)  # 227 KB per block: fits
    for knobs, name in (({"num_warps": 3}, "num_warps"), ({"num_warps": 64}, "num_warps"),
                        ({"num_stages": 4}, "num_stages"), ({"num_splits": 0}, "num_splits")):
        case = decode_case("decode", batch=4, q_heads=32, kv_heads=8, context=1024, **knobs)
        with abstract_gpu(A100), pytest.raises(ValueError, match=f"^{name}: "):
            jax.jit(case.fn).trace(*case.shapes)
    case = prefill_case("prefill", tokens=256, seqs=2, q_heads=8, kv_heads=8, context=1024, block_k=512)
    with abstract_gpu(A100), pytest.raises(ValueError, match=r"^block_k: paged prefill"):
        jax.jit(case.fn).trace(*case.shapes)


ON_GPU = jax.default_backend() == "gpu"


@pytest.mark.skipif(ON_GPU, reason="CPU defaults")
def test_cpu_defaults():
    assert current_target() == A100  # no GPU, no abstract device: the tighter supported target
    # The native decode kernel where it builds (a C++ compiler), the XLA path otherwise.
    assert resolve_backend("auto") == ("cpu_native" if native_cpu.available() else "xla")


def test_target_selection():
    with abstract_gpu(H100):
        assert current_target() == H100
    assert target_for_capability(90, num_sms=114).num_sms == 114  # H100 PCIe
    assert target_for_capability(100).smem_per_block == H100.smem_per_block  # newer: nearest lower entry
    with pytest.raises(ValueError, match="sm_80"):
        target_for_capability(75)


def test_backend_registry_names_every_backend():
    assert set(BACKEND_NAMES) == {"auto", "pallas", *BACKENDS}
    assert resolve_backend("pallas") == "pallas_triton"
    params = BACKENDS["pallas_triton"].compiler_params(num_warps=8, num_stages=2)
    assert (params.num_warps, params.num_stages) == (8, 2)
    with pytest.raises(ValueError, match="has no Pallas lowering"):
        BACKENDS["xla"].compiler_params(num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="backend: must be one of"):
        resolve_backend("mosaic")
