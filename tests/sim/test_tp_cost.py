"""The simulator's tensor-parallel cost on a hand-computed case: OPT-175B on 8 A100-80GB (Table 1).

Megatron splits every layer over the 8 GPUs and all-reduces the hidden state twice per layer
(after attention and after the MLP). A ring all-reduce of M bytes sends 2 (p - 1) / p x M per GPU.
"""

import dataclasses

import numpy as np
import pytest

from jpaged.models.presets import get_preset
from jpaged.sim.cost_model import CostModel, CostModelConfig
from jpaged.sim.gpus import get_gpu

OPT175B = get_preset("opt-175b")  # hidden 12288, 96 layers
A100_80 = get_gpu("a100-80gb")  # 2039 GB/s HBM, 300 GB/s NVLink per direction
# Ideal compute and memory, no per-step or per-layer overheads; NVLink at 80% and 10 us per
# all-reduce, so the communication terms are the only non-datasheet numbers.
CONFIG = CostModelConfig(hbm_efficiency=1.0, gemm_efficiency=1.0, attention_efficiency=1.0,
                         layer_overhead_s=0.0, step_overhead_s=0.0, nvlink_efficiency=0.8,
                         allreduce_latency_s=1e-5)
WEIGHTS_PER_GPU = OPT175B.param_bytes("float16") / 8 / 2039e9  # 43.6 GB per GPU -> 21.4 ms


def test_decode_all_reduce_by_hand():
    model = CostModel(OPT175B, A100_80, CONFIG, tp=8)
    # 16 sequences: each all-reduce carries 16 x 12288 x 2 B = 393,216 B; a ring moves 2 x 7/8 of it
    # = 688,128 B per GPU over 300 GB/s x 0.8 = 240 GB/s: 2.867 us. 2 x 96 = 192 of them: 550.5 us,
    # plus 192 x 10 us of latency: 1.92 ms. Communication total: 2.4705 ms.
    comm = 192 * (688_128 / 240e9) + 192 * 1e-5
    assert comm == pytest.approx(2.4705e-3, rel=1e-4)
    assert model.decode_time(np.zeros(16, np.int32)) == pytest.approx(WEIGHTS_PER_GPU + comm, rel=1e-9)


def test_prefill_all_reduce_scales_with_tokens():
    model = CostModel(OPT175B, A100_80, CONFIG, tp=8)
    # The same step with free communication: an infinitely fast link and no all-reduce latency.
    free = CostModel(OPT175B, dataclasses.replace(A100_80, nvlink_bw=float("inf")),
                     dataclasses.replace(CONFIG, allreduce_latency_s=0.0), tp=8)
    # One 512-token prompt: 512 x 12288 x 2 B = 12,582,912 B per all-reduce, x 1.75 = 22,020,096 B
    # per GPU over 240 GB/s = 91.75 us; x 192 = 17.616 ms, + 1.92 ms latency = 19.536 ms.
    lens = np.array([512])
    assert model.prefill_time(lens, lens) - free.prefill_time(lens, lens) == pytest.approx(19.536e-3, rel=1e-4)


def test_one_gpu_has_no_communication():
    model = CostModel(OPT175B, A100_80, CONFIG, tp=1)
    assert model.decode_time(np.zeros(16, np.int32)) == pytest.approx(OPT175B.param_bytes("float16") / 2039e9,
                                                                       rel=1e-9)
