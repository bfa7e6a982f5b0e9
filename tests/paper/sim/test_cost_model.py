"""Cost model on hand-computed cases (OPT-13B on A100-40GB unless stated)."""

import dataclasses
import time

import numpy as np
import pytest

from jpaged.config.presets import get_preset
from jpaged.paper.sim.cost_model import PARTS, CostModel, CostModelConfig
from jpaged.paper.sim.gpus import get_gpu
from jpaged.paper.sim.measured import VIDUR_A100

OPT13B = get_preset("opt-13b")
A100 = get_gpu("a100-40gb")
# Datasheet hardware, no fixed costs, roofline exponent 1 (memory + compute add): every term
# below is a datasheet number over a byte or FLOP count.
IDEAL = CostModelConfig(hbm_efficiency=1.0, tensor_core_efficiency=1.0, gemm_kernel_s=0.0, roofline_exponent=1.0,
                        elementwise_efficiency=1.0, elementwise_floor_s=0.0, attention_efficiency=1.0,
                        paged_attention_overhead=1.2, nvlink_efficiency=1.0, allreduce_floor_s=0.0,
                        allreduce_fixed_s=0.0, host_overhead_s=0.0, host_overhead_per_seq_s=0.0)
GEMM_PARAMS = 40 * (4 * 5120**2 + 2 * 5120 * 20480)  # fused qkv + out, fc1 + fc2, 40 layers: 12.58 G
HEAD_PARAMS = 50272 * 5120  # LM head (tied embedding)
KV_PER_TOKEN = 819_200  # 2 x 40 layers x 5120 x 2 B = 800 KiB (PAPER.md)
ELEMENTWISE_BYTES = 40 * (10 * 5120 + 2 * 20480) * 2  # 2 LayerNorms, 2 residual adds, ReLU per layer, per token
PAIR_FLOPS = 4 * 5120 * 40  # QK^T and PV per (query, key) pair


def test_decode_batch_1_by_hand():
    model = CostModel(OPT13B, A100, IDEAL)
    gemm = (2 * GEMM_PARAMS + 2 * HEAD_PARAMS) / 1555e9 + (2 * GEMM_PARAMS + 2 * HEAD_PARAMS) / 312e12
    elementwise = ELEMENTWISE_BYTES / 1555e9
    attention = KV_PER_TOKEN / 1555e9 + 100 * KV_PER_TOKEN * 1.2 / 1555e9  # write 1 token, read 100 x paged overhead
    parts = model.breakdown(np.array([1]), np.array([100]))
    assert parts == pytest.approx({"gemm": gemm, "elementwise": elementwise, "attention": attention,
                                   "communication": 0.0, "host": 0.0}, rel=1e-9)
    # 25.68 GB of weights / 1555 GB/s = 16.52 ms, + 82 us of FLOPs, + 64 us of KV.
    assert model.decode_time(np.array([100])) == pytest.approx(16.67e-3, rel=1e-3)


def test_prefill_and_chunked_prefill_by_hand():
    model = CostModel(OPT13B, A100, IDEAL)
    # One 1024-token prompt: 1024 x 2 x 12.58 G FLOP = 25.8 TFLOP of GEMMs -> 82.6 ms + the weight read.
    gemm = (2 * GEMM_PARAMS / 1555e9 + 1024 * 2 * GEMM_PARAMS / 312e12  # weights read + FLOPs (p = 1: they add)
            + 2 * HEAD_PARAMS / 1555e9 + 2 * HEAD_PARAMS / 312e12)  # LM head: one sampled row
    attention = 1024 * KV_PER_TOKEN / 1555e9 + 1024 * 1025 / 2 * PAIR_FLOPS / 312e12  # write + causal FLOPs
    parts = model.breakdown(np.array([1024]), np.array([1024]))
    assert parts["gemm"] == pytest.approx(gemm, rel=1e-9)
    assert parts["attention"] == pytest.approx(attention, rel=1e-9)
    assert parts["elementwise"] == pytest.approx(1024 * ELEMENTWISE_BYTES / 1555e9, rel=1e-9)
    # A chunk of 64 after a cached 512 (chunked prefill, recompute, prefix hit): each query also
    # sees the 512 keys; reading 576 tokens of KV (0.30 ms) outlasts 34,848 pairs of FLOPs (0.09 ms).
    pairs = 64 * 512 + 64 * 65 / 2
    assert pairs * PAIR_FLOPS / 312e12 < 576 * KV_PER_TOKEN / 1555e9
    parts = model.breakdown(np.array([64]), np.array([576]))
    assert parts["attention"] == pytest.approx(64 * KV_PER_TOKEN / 1555e9 + 576 * KV_PER_TOKEN / 1555e9, rel=1e-9)


def test_mixed_batch_is_one_step():
    model = CostModel(OPT13B, A100, IDEAL)
    q, ctx = np.array([1, 1, 64]), np.array([100, 200, 576])
    parts = model.breakdown(q, ctx)
    gemm = 2 * GEMM_PARAMS / 1555e9 + 66 * 2 * GEMM_PARAMS / 312e12 + 2 * HEAD_PARAMS / 1555e9 \
        + 3 * 2 * HEAD_PARAMS / 312e12  # one weight read for 66 tokens; 3 sampled rows
    attention = (66 * KV_PER_TOKEN / 1555e9 + 300 * KV_PER_TOKEN * 1.2 / 1555e9  # writes; decode reads
                 + 576 * KV_PER_TOKEN / 1555e9)  # the chunk's read (memory-bound, as above)
    assert parts["gemm"] == pytest.approx(gemm, rel=1e-9) and parts["attention"] == pytest.approx(attention, rel=1e-9)
    # With the measured defaults a mixed step is far cheaper than its decode and prefill halves
    # run apart: the weights are read once and the host works once.
    real = CostModel(OPT13B, A100)
    apart = real.decode_time(np.array([100, 200])) + real.prefill_time(np.array([64]), np.array([576]))
    assert real.step_time(q, ctx) < 0.65 * apart
    assert real.step_time(np.zeros(0, np.int32), np.zeros(0, np.int32)) == 0.0


def test_measured_defaults_add_host_and_kernel_costs():
    model = CostModel(OPT13B, A100)
    line = VIDUR_A100.host_overhead(1)
    for batch in (8, 32, 64):
        parts = model.breakdown(np.ones(batch, np.int32), np.full(batch, 200, np.int32))
        assert parts["host"] == pytest.approx(line.fixed_s + line.per_seq_s * batch, rel=1e-12)
        # Memory-bound GEMMs: the weights at the achieved bandwidth plus 161 kernels' fixed time, and
        # no more than the roofline's transition adds (below 10% at these batches).
        floor = (2 * (GEMM_PARAMS + HEAD_PARAMS) / (1555e9 * VIDUR_A100.hbm_efficiency)
                 + 161 * VIDUR_A100.gemm_kernel_s)
        assert floor < parts["gemm"] < 1.1 * floor
        assert parts["elementwise"] == pytest.approx(40 * VIDUR_A100.elementwise_floor_s)  # launch-bound
    assert 0.3 < line.fixed_s * 1e3 < 5 and 0.05 < line.per_seq_s * 1e3 < 0.5  # ms: a sanity range


def test_large_batches_turn_compute_bound():
    sharp = CostModel(OPT13B, A100, dataclasses.replace(IDEAL, roofline_exponent=64.0))
    parts = sharp.breakdown(np.ones(4096, np.int32), np.ones(4096, np.int32))
    assert parts["gemm"] == pytest.approx(4096 * 2 * (GEMM_PARAMS + HEAD_PARAMS) / 312e12, rel=0.02)
    smooth = CostModel(OPT13B, A100)
    for batch in (16, 128, 512, 2048):  # the smooth roofline lies between max(memory, compute) and their sum
        gemm = smooth.breakdown(np.ones(batch, np.int32), np.ones(batch, np.int32))["gemm"]
        mem = 2 * GEMM_PARAMS / (1555e9 * VIDUR_A100.hbm_efficiency)
        compute = batch * 2 * GEMM_PARAMS / (312e12 * VIDUR_A100.tensor_core_efficiency)
        assert max(mem, compute) < gemm < mem + compute + 2 * HEAD_PARAMS / 1e12 + 161 * VIDUR_A100.gemm_kernel_s


def test_tensor_parallel_all_reduce():
    spec = get_preset("opt-66b")  # hidden 9216, 64 layers
    config = dataclasses.replace(IDEAL, allreduce_floor_s=60e-6, allreduce_fixed_s=30e-6)
    model = CostModel(spec, A100, config, tp=4)
    # 8 tokens: 8 x 9216 x 2 B x 2 (4 - 1) / 4 = 221 KB per GPU over 300 GB/s = 0.74 us: under the
    # 60 us floor. 2 all-reduces x 64 layers.
    assert model.breakdown(np.ones(8, np.int32), np.ones(8, np.int32))["communication"] == pytest.approx(128 * 60e-6)
    # 2048 prompt tokens: 56.6 MB per GPU -> 188.7 us + 30 us fixed.
    comm = 128 * (30e-6 + 2048 * 9216 * 2 * 1.5 / 300e9)
    assert model.breakdown(np.array([2048]), np.array([2048]))["communication"] == pytest.approx(comm, rel=1e-9)
    with pytest.raises(ValueError, match="tp must"):
        CostModel(spec, A100, tp=5)


def test_host_overhead_line_per_tp_and_override():
    spec = get_preset("opt-175b")
    assert VIDUR_A100.host_overhead(8) == VIDUR_A100.host_overhead(4)  # TP 8 unmeasured: TP 4's line
    tp8 = CostModel(spec, A100, tp=8).breakdown(np.ones(16, np.int32), np.ones(16, np.int32))
    assert tp8["host"] == pytest.approx(VIDUR_A100.host_overhead(4).seconds(16))
    fixed = CostModel(spec, A100, CostModelConfig(host_overhead_s=1e-3, host_overhead_per_seq_s=0.0), tp=8)
    assert fixed.breakdown(np.ones(16, np.int32), np.ones(16, np.int32))["host"] == 1e-3
    with pytest.raises(ValueError, match="tp must be >= 1"):
        VIDUR_A100.host_overhead(0)


def test_gqa_kv_heads_replicate_when_tp_exceeds_them():
    spec = get_preset("tiny-llama")  # 2 KV heads
    assert CostModel(spec, A100, tp=4).kv_bytes_per_token == spec.kv_bytes_per_token("float16") / 2
    assert CostModel(spec, A100, tp=2).kv_bytes_per_token == spec.kv_bytes_per_token("float16") / 2
    assert CostModel(spec, A100, tp=1).kv_bytes_per_token == spec.kv_bytes_per_token("float16")


def test_swap_and_copy():
    model = CostModel(OPT13B, A100)
    # Block of 16 tokens = 12.8 MiB over 25 GB/s = 524 us, + 2 x 40 copies x 5 us = 400 us.
    assert model.swap_time(3) == pytest.approx(3 * (16 * KV_PER_TOKEN / 25e9 + 80 * 5e-6), rel=1e-9)
    hbm = 1555e9 * VIDUR_A100.hbm_efficiency
    assert model.copy_time(2) == pytest.approx(2 * 2 * 16 * KV_PER_TOKEN / hbm, rel=1e-9)
    assert model.swap_time(0) == model.copy_time(0) == 0.0
    # Per token swapped, block size 1 is >10x slower than block size 256 (Fig. 19's trend).
    per_token = [CostModel(OPT13B, A100, block_size=b).swap_time(1) / b for b in (1, 16, 256)]
    assert per_token[0] > 10 * per_token[2] and per_token[0] > per_token[1] > per_token[2]


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="cost.hbm_efficiency"):
        CostModelConfig(hbm_efficiency=1.5)
    with pytest.raises(ValueError, match="cost.paged_attention_overhead"):
        CostModelConfig(paged_attention_overhead=0.9)
    with pytest.raises(ValueError, match="cost.roofline_exponent"):
        CostModelConfig(roofline_exponent=0.5)
    with pytest.raises(ValueError, match="cost.host_overhead_s"):
        CostModelConfig(host_overhead_s=-1.0)
    with pytest.raises(ValueError, match="gpu must be one of"):
        get_gpu("v100")


def test_breakdown_sums_to_step_time():
    model = CostModel(get_preset("opt-66b"), A100, tp=4)
    q, ctx = np.array([1, 1, 1, 300, 20]), np.array([50, 900, 7, 300, 1020])
    parts = model.breakdown(q, ctx)
    assert list(parts) == list(PARTS) and all(v > 0 for v in parts.values())
    assert model.step_time(q, ctx) == pytest.approx(sum(parts.values()), rel=1e-12)


def test_step_cost_is_microseconds():
    model, context = CostModel(OPT13B, A100), np.full(64, 300, np.int32)
    mixed_q = np.array([1] * 63 + [128], np.int32)
    start = time.process_time()  # CPU time: wall time on a shared machine measures its load
    for _ in range(10_000):
        model.decode_time(context)
        model.step_time(mixed_q, context)
    assert (time.process_time() - start) / 20_000 < 40e-6  # ~5 us here; loose for shared CPUs
