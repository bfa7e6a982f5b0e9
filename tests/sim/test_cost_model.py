"""Roofline cost model on hand-computed cases (OPT-13B on A100-40GB unless stated)."""

import time

import numpy as np
import pytest

from jpaged.models.presets import get_preset
from jpaged.sim.cost_model import CostModel, CostModelConfig
from jpaged.sim.gpus import get_gpu

OPT13B = get_preset("opt-13b")
A100 = get_gpu("a100-40gb")
# Ideal hardware, no overheads: every term below is a datasheet number over a byte or FLOP count.
IDEAL = CostModelConfig(hbm_efficiency=1.0, gemm_efficiency=1.0, attention_efficiency=1.0,
                        paged_attention_overhead=1.2, layer_overhead_s=0.0, step_overhead_s=0.0,
                        allreduce_latency_s=0.0, nvlink_efficiency=1.0)
WEIGHT_BYTES = 25_706_946_560  # OPT-13B fp16: 12,853,473,280 parameters x 2 B
KV_PER_TOKEN = 819_200  # 2 x 40 layers x 5120 x 2 B = 800 KiB (PAPER.md)
LINEAR_PARAMS = 40 * (4 * 5120**2 + 2 * 5120 * 20480)  # q, k, v, out + fc1, fc2 per layer


def test_decode_batch_1_is_the_weight_read():
    model = CostModel(OPT13B, A100, IDEAL)
    # 25.7 GB / 1555 GB/s = 16.53 ms, plus 100 context tokens x 800 KiB x 1.2 paged overhead.
    expected = WEIGHT_BYTES / 1555e9 + 100 * KV_PER_TOKEN * 1.2 / 1555e9
    assert model.decode_time(np.array([100])) == pytest.approx(expected, rel=1e-9)
    assert expected == pytest.approx(16.59e-3, rel=1e-3)


def test_decode_with_default_efficiencies():
    # 25.7 GB / (1555 GB/s x 0.85) = 19.45 ms; + 40 layers x 15 us + 1 ms host step overhead.
    model = CostModel(OPT13B, A100)
    expected = WEIGHT_BYTES / (1555e9 * 0.85) + 40 * 15e-6 + 1e-3
    assert model.decode_time(np.zeros(1, np.int32)) == pytest.approx(expected, rel=1e-9)
    assert expected == pytest.approx(21.05e-3, rel=1e-3)


def test_decode_turns_compute_bound_at_large_batches():
    model = CostModel(OPT13B, A100, IDEAL)
    batch = 1024  # 1024 x 2 x 12.58 G FLOP = 25.8 TFLOP > 16.5 ms x 312 TFLOP/s = 5.2 TFLOP
    flops = batch * (2 * LINEAR_PARAMS + 2 * 5120 * 50272)
    assert model.decode_time(np.zeros(batch, np.int32)) == pytest.approx(flops / 312e12, rel=1e-9)


def test_prefill_hand_case():
    model = CostModel(OPT13B, A100, IDEAL)
    # One 1024-token prompt: GEMMs 1024 x 2 x 12.58e9 + LM head of one row = 25.8 TFLOP -> 82.6 ms.
    linear = (1024 * 2 * LINEAR_PARAMS + 2 * 5120 * 50272) / 312e12
    # Causal attention: 1024 x 1025 / 2 pairs x 4 x 5120 x 40 FLOP = 0.43 TFLOP -> 1.38 ms.
    attention = 1024 * 1025 / 2 * 4 * 5120 * 40 / 312e12
    got = model.prefill_time(np.array([1024]), np.array([1024]))
    assert got == pytest.approx(linear + attention, rel=1e-9)
    assert got == pytest.approx(84.0e-3, rel=2e-3)
    # A cached prefix of 512 (recompute or prefix hit): each of 64 queries also sees the 512 keys.
    pairs = 64 * 512 + 64 * 65 / 2
    got = model.prefill_time(np.array([64]), np.array([576]))
    expected = (WEIGHT_BYTES / 1555e9  # 64 tokens is still bandwidth-bound
                + max(pairs * 4 * 5120 * 40 / 312e12, 576 * KV_PER_TOKEN / 1555e9))
    assert got == pytest.approx(expected, rel=1e-9)


def test_tensor_parallel_all_reduce():
    spec = get_preset("opt-66b")
    model = CostModel(spec, A100, IDEAL, tp=4)
    # 8 tokens: 2 all-reduces x 64 layers of 8 x 9216 x 2 B, ring 2 (4 - 1) / 4 over 300 GB/s.
    comm = 2 * 64 * 8 * 9216 * 2 * 1.5 / 300e9
    expected = spec.param_bytes("float16") / 4 / 1555e9 + comm
    assert model.decode_time(np.zeros(8, np.int32)) == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="tp must"):
        CostModel(spec, A100, tp=5)


def test_gqa_kv_heads_replicate_when_tp_exceeds_them():
    spec = get_preset("tiny-llama")  # 2 KV heads
    assert CostModel(spec, A100, tp=4).kv_bytes_per_token == spec.kv_bytes_per_token("float16") / 2
    assert CostModel(spec, A100, tp=2).kv_bytes_per_token == spec.kv_bytes_per_token("float16") / 2
    assert CostModel(spec, A100, tp=1).kv_bytes_per_token == spec.kv_bytes_per_token("float16")


def test_swap_and_copy():
    model = CostModel(OPT13B, A100)
    # Block of 16 tokens = 12.8 MiB over 25 GB/s = 524 us, + 2 x 40 copies x 5 us = 400 us.
    assert model.swap_time(3) == pytest.approx(3 * (16 * KV_PER_TOKEN / 25e9 + 80 * 5e-6), rel=1e-9)
    assert model.copy_time(2) == pytest.approx(2 * 2 * 16 * KV_PER_TOKEN / (1555e9 * 0.85), rel=1e-9)
    assert model.swap_time(0) == model.copy_time(0) == 0.0
    # Per token swapped, block size 1 is >10x slower than block size 256 (Fig. 19's trend).
    per_token = [CostModel(OPT13B, A100, block_size=b).swap_time(1) / b for b in (1, 16, 256)]
    assert per_token[0] > 10 * per_token[2] and per_token[0] > per_token[1] > per_token[2]


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="cost.hbm_efficiency"):
        CostModelConfig(hbm_efficiency=1.5)
    with pytest.raises(ValueError, match="cost.paged_attention_overhead"):
        CostModelConfig(paged_attention_overhead=0.9)
    with pytest.raises(ValueError, match="cost.step_overhead_s"):
        CostModelConfig(step_overhead_s=-1.0)
    with pytest.raises(ValueError, match="gpu must be one of"):
        get_gpu("v100")


def test_decode_step_cost_is_microseconds():
    model, context = CostModel(OPT13B, A100), np.full(64, 300, np.int32)
    start = time.perf_counter()
    for _ in range(20_000):
        model.decode_time(context)
    assert (time.perf_counter() - start) / 20_000 < 20e-6  # ~1.5 us here; loose for shared CPUs
