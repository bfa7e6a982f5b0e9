"""The verify step's cost model and speculation's throughput, on hand-computed cases (OPT-13B, A100-40GB)."""

import numpy as np
import pytest

from jpaged.config.presets import get_preset
from jpaged.paper.sim.cost_model import CostModel, CostModelConfig
from jpaged.paper.sim.gpus import get_gpu
from jpaged.paper.sim.speculative import (SpeculativeCostModel, expected_tokens, max_batch,
                                          pool_blocks_with_draft)

OPT13B, OPT125M = get_preset("opt-13b"), get_preset("opt-125m")
A100 = get_gpu("a100-40gb")
# Datasheet hardware without fixed costs and with memory + compute adding (as in test_cost_model).
IDEAL = CostModelConfig(hbm_efficiency=1.0, tensor_core_efficiency=1.0, gemm_kernel_s=0.0, roofline_exponent=1.0,
                        elementwise_efficiency=1.0, elementwise_floor_s=0.0, attention_efficiency=1.0,
                        paged_attention_overhead=1.2, nvlink_efficiency=1.0, allreduce_floor_s=0.0,
                        allreduce_fixed_s=0.0, host_overhead_s=0.0, host_overhead_per_seq_s=0.0)
GEMM_PARAMS = 40 * (4 * 5120**2 + 2 * 5120 * 20480)
HEAD_PARAMS = 50272 * 5120
KV_PER_TOKEN = 819_200
ELEMENTWISE_BYTES = 40 * (10 * 5120 + 2 * 20480) * 2
PAIR_FLOPS = 4 * 5120 * 40


def test_expected_tokens():
    assert expected_tokens(0.5, 0) == 1.0 and expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)  # P(emit >= i) = a^(i - 1)
    assert expected_tokens(0.9, 4) == pytest.approx(sum(0.9**i for i in range(5)))
    assert expected_tokens(1.0, 4) == 5.0
    with pytest.raises(ValueError, match="acceptance"):
        expected_tokens(1.5, 2)


def test_verify_step_by_hand():
    # B = 2 sequences at context 100, k = 3 drafts: 8 query tokens, every one through the LM head,
    # each row reading its 103 tokens of context through the paged kernel (memory-bound here).
    model = SpeculativeCostModel(CostModel(OPT13B, A100, IDEAL))
    gemm = (2 * GEMM_PARAMS + 2 * HEAD_PARAMS) / 1555e9 + 8 * 2 * (GEMM_PARAMS + HEAD_PARAMS) / 312e12
    pairs = 2 * (4 * 99 + 4 * 5 / 2)  # q (c - q) + q (q + 1) / 2 per row, q = 4, c = 103
    assert pairs * PAIR_FLOPS / 312e12 < 206 * KV_PER_TOKEN * 1.2 / 1555e9
    attention = 8 * KV_PER_TOKEN / 1555e9 + 206 * KV_PER_TOKEN * 1.2 / 1555e9
    expected = gemm + 8 * ELEMENTWISE_BYTES / 1555e9 + attention
    assert model.verify_time(2, 100, 3) == pytest.approx(expected, rel=1e-9)
    # Not a verify step (a chunked prefill): the last row's logits only, the contiguous read.
    chunk = model.target.step_time(np.full(2, 4), np.full(2, 103))
    assert expected - chunk == pytest.approx(6 * 2 * HEAD_PARAMS / 312e12 + 206 * KV_PER_TOKEN * 0.2 / 1555e9, rel=1e-9)


def test_k0_is_the_decode_step_and_ngram_drafts_for_free():
    target = CostModel(OPT13B, A100)
    ngram = SpeculativeCostModel(target)
    for batch in (1, 16, 64):
        assert ngram.step_time(batch, 400, 0) == target.decode_time(np.full(batch, 400))
        assert ngram.draft_time(batch, 400, 4) == 0.0
        assert ngram.throughput(batch, 400, 0, 0.7) == pytest.approx(batch / target.decode_time(np.full(batch, 400)))


def test_draft_model_pays_k_decode_steps():
    target, draft = CostModel(OPT13B, A100), CostModel(OPT125M, A100)
    model = SpeculativeCostModel(target, draft)
    steps = sum(draft.decode_time(np.full(8, 400 + j)) for j in range(3))
    assert model.draft_time(8, 400, 3) == pytest.approx(steps)
    assert model.step_time(8, 400, 3) == pytest.approx(steps + model.verify_time(8, 400, 3))


def test_pays_when_memory_bound_and_crossover():
    # Batch 1 is weight-bound: a verify of 5 tokens costs barely more than a decode of 1, so tok/s
    # grows almost by the expected tokens per step.
    model = SpeculativeCostModel(CostModel(OPT13B, A100))
    assert model.verify_time(1, 400, 4) < 1.05 * model.verify_time(1, 400, 0)
    assert model.throughput(1, 400, 4, 0.7) / model.throughput(1, 400, 0, 0.0) > 0.95 * expected_tokens(0.7, 4)
    # Nothing accepted: one token per step for a dearer step, so it never pays.
    assert model.crossover(400, 2, 0.0, 64) == 1
    # The draft model's steps make speculation stop paying at a finite batch; the speedup falls with B.
    drafted = SpeculativeCostModel(CostModel(OPT13B, A100), CostModel(OPT125M, A100))
    cross = drafted.crossover(400, 4, 0.5, 256)
    assert cross is not None and 1 < cross < 256
    assert drafted.throughput(cross - 1, 400, 4, 0.5) > model.throughput(cross - 1, 400, 0, 0.0)
    assert drafted.throughput(cross, 400, 4, 0.5) <= model.throughput(cross, 400, 0, 0.0)


def test_memory_caps():
    # Table 1's pool: 983 blocks of 16 = 15,728 slots; at context 423 each sequence holds 423 + k slots
    # plus 7.5 empty ones of its last block on average.
    assert max_batch(983, 16, 423, 0) == 15728 // 430.5 == 36
    assert max_batch(100, 16, 100, 0) == 14 and max_batch(100, 16, 100, 8) == 13
    target, draft = CostModel(OPT13B, A100), CostModel(OPT125M, A100)
    # OPT-125M: 36,864 B of KV per token beside OPT-13B's 819,200, and its weights out of the pool.
    assert draft.block_bytes == 16 * 36_864 and target.block_bytes == 16 * KV_PER_TOKEN
    weights = OPT125M.param_bytes()
    blocks = pool_blocks_with_draft(983, target, draft, weights)
    assert blocks == (983 * 16 * KV_PER_TOKEN - weights) // (16 * (KV_PER_TOKEN + 36_864))
    assert 900 < blocks < 983


def test_batch_expansion_is_a_decode_step_of_k_plus_1_rows_per_sequence():
    target = CostModel(OPT13B, A100)
    expanded, mqa = SpeculativeCostModel(target, batch_expansion=True), SpeculativeCostModel(target)
    rows = np.array([400, 401, 402] * 16)  # 16 sequences, k = 2: contexts 400..402 each
    assert expanded.verify_time(16, 400, 2) == pytest.approx(target.decode_time(rows))
    # It reads each context k + 1 times and pays the host's per-sequence work per row.
    assert expanded.verify_time(16, 400, 2) > 1.2 * mqa.verify_time(16, 400, 2)
    assert expanded.verify_time(16, 400, 0) == mqa.verify_time(16, 400, 0)
