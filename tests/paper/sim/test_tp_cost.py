"""The simulator's tensor-parallel cost on a hand-computed case: OPT-175B on 8 A100-80GB (Table 1).

Megatron splits every layer over the 8 GPUs and all-reduces the hidden state twice per layer
(after attention and after the MLP). A ring all-reduce of M bytes sends 2 (p - 1) / p x M per GPU;
its time is max(floor, fixed + those bytes / bus bandwidth), measured on an A100 NVLink pair.
"""

import dataclasses

import numpy as np
import pytest

from jpaged.config.presets import get_preset
from jpaged.paper.sim.cost_model import CostModel, CostModelConfig
from jpaged.paper.sim.gpus import get_gpu
from jpaged.paper.sim.measured import VIDUR_A100

OPT175B = get_preset("opt-175b")  # hidden 12288, 96 layers
A100_80 = get_gpu("a100-80gb")  # 300 GB/s NVLink per direction


def comm_s(model: CostModel, num_tokens: int) -> float:
    return model.breakdown(np.ones(num_tokens, np.int32), np.ones(num_tokens, np.int32))["communication"]


def test_decode_all_reduce_by_hand():
    config = CostModelConfig(nvlink_efficiency=0.64, allreduce_floor_s=60e-6, allreduce_fixed_s=30e-6)
    model = CostModel(OPT175B, A100_80, config, tp=8)
    # 16 sequences: each all-reduce carries 16 x 12288 x 2 B = 393,216 B; a ring moves 2 x 7/8 of it
    # = 688,128 B per GPU over 300 GB/s x 0.64 = 192 GB/s: 3.58 us + 30 us fixed < the 60 us floor.
    # 2 x 96 = 192 of them: 11.52 ms.
    assert comm_s(model, 16) == pytest.approx(192 * 60e-6, rel=1e-12)
    # 512 sequences: 20.6 MB per GPU -> 107.5 us + 30 us = 137.5 us each; 192 -> 26.4 ms.
    assert comm_s(model, 512) == pytest.approx(192 * (30e-6 + 512 * 12288 * 2 * 1.75 / 192e9), rel=1e-9)


def test_measured_all_reduce_is_the_default():
    model = CostModel(OPT175B, A100_80, tp=8)
    floor = VIDUR_A100.allreduce_floor_s
    assert 30e-6 < floor < 100e-6 and 0.4 < VIDUR_A100.nvlink_efficiency < 0.9  # plausible NCCL on NVLink
    assert comm_s(model, 16) == pytest.approx(192 * floor, rel=1e-12)
    # The old fixed 10 us latency: the measured floor is several times larger.
    assert comm_s(model, 16) > 192 * 3 * 10e-6


def test_prefill_all_reduce_scales_with_tokens():
    model = CostModel(OPT175B, A100_80, tp=8)
    lens = np.array([2048])
    # 2048 tokens: 88 MB per GPU at the measured bus bandwidth, far above the floor.
    expected = 192 * (VIDUR_A100.allreduce_fixed_s
                      + 2048 * 12288 * 2 * 1.75 / (300e9 * VIDUR_A100.nvlink_efficiency))
    assert model.breakdown(lens, lens)["communication"] == pytest.approx(expected, rel=1e-9)


def test_one_gpu_has_no_communication():
    model = CostModel(OPT175B, A100_80, tp=1)
    assert comm_s(model, 16) == 0.0
    free_link = CostModel(OPT175B, dataclasses.replace(A100_80, nvlink_bw=float("inf")),
                          CostModelConfig(allreduce_floor_s=0.0, allreduce_fixed_s=0.0), tp=8)
    assert comm_s(free_link, 16) == 0.0
