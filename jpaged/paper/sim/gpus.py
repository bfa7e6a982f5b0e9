"""Datasheet numbers of the GPUs the simulator models (PAPER.md, "Hardware facts").

Bandwidths are peak figures; achievable fractions live in `CostModelConfig`, so that one place
holds every efficiency assumption.
"""

from __future__ import annotations

import dataclasses

_MIB = 2**20


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    """One GPU's memory, bandwidths and peak compute."""

    name: str
    memory_bytes: int  # HBM capacity as the driver reports it (nvidia-smi total)
    hbm_bw: float  # peak HBM bandwidth, bytes/s
    fp16_flops: float  # dense FP16/BF16 tensor-core peak, FLOP/s
    nvlink_bw: float  # NVLink bandwidth per GPU per direction, bytes/s (half the bidirectional figure)
    pcie_bw: float  # practical host<->device copy bandwidth per direction, bytes/s


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    # A100: 1,555 GB/s HBM2 (40 GB) / 2,039 GB/s HBM2e (80 GB SXM); 312 TFLOP/s dense FP16;
    # NVLink 3: 12 links x 50 GB/s = 600 GB/s bidirectional; PCIe 4.0 x16 ~25 GB/s in practice.
    GpuSpec("a100-40gb", 40960 * _MIB, 1555e9, 312e12, 300e9, 25e9),
    GpuSpec("a100-80gb", 81920 * _MIB, 2039e9, 312e12, 300e9, 25e9),
    # A100-80GB PCIe: 1,935 GB/s HBM2e, the same tensor peak; NVLink bridges join GPUs in pairs
    # (3 bridges, 600 GB/s bidirectional). The GPU of Vidur's measurements (sim/fit_vidur.py).
    GpuSpec("a100-80gb-pcie", 81920 * _MIB, 1935e9, 312e12, 300e9, 25e9),
    # H100 SXM: 3.35 TB/s HBM3, ~990 TFLOP/s dense FP16; NVLink 4: 900 GB/s bidirectional;
    # PCIe 5.0 x16: 64 GB/s per direction raw, ~50 GB/s practical (the 25 -> 50 doubling of Gen5).
    GpuSpec("h100", 81559 * _MIB, 3.35e12, 989e12, 450e9, 50e9),
    # H200: H100's compute and links, 4.8 TB/s HBM3e (4.3 TB/s measured device copy), 141 GB.
    GpuSpec("h200", 143771 * _MIB, 4.8e12, 989e12, 450e9, 50e9),
)}


def get_gpu(name: str) -> GpuSpec:
    """The `GpuSpec` called `name`; ValueError listing the known names otherwise."""
    if name not in GPUS:
        raise ValueError(f"gpu must be one of {', '.join(GPUS)}; got {name!r}")
    return GPUS[name]
