"""All-reduce priced across hosts: a tensor-parallel group whose GPUs sit in several servers.

Within a server the cost model prices Megatron's all-reduces on NVLink with constants measured on an
A100 pair (`CostModelConfig`: t = max(floor, fixed + ring bytes / bus bandwidth), ring bytes
2 (tp - 1) / tp of the message). Across servers NCCL runs the same ring through the servers'
network adapters, rail by rail (GPU i of every server on its own adapter), so the ring's bus
bandwidth is the smaller of NVLink's and what a server's adapters carry together, and each
all-reduce pays the network's latency on top. The link's figures, each with its source:
- 200 Gb/s HDR InfiniBand per adapter, one per GPU: the DGX A100 datasheet (eight single-port
  ConnectX-6 HDR adapters for the compute fabric), 25 GB/s per direction;
- 0.9 of the line rate reached as all-reduce bus bandwidth: NVIDIA/nccl issue #1048, two 8x A100
  servers with four 200 Gb/s adapters each, 86 of a theoretical 96 GB/s;
- 20 us more per all-reduce for each further server: NVIDIA/nccl-tests issue #150, whose log of
  all_reduce_perf between two A100 servers over HDR (one GPU each) shows 19-20 us for 8-128 byte
  messages (the thread is about a failure at larger sizes). Added whole on top of the measured
  in-server floor it overstates a little: part of those 20 us is launch work the floor holds.
"""

from __future__ import annotations

import dataclasses

from jpaged.paper.sim.cost_model import CostModelConfig
from jpaged.paper.sim.gpus import GpuSpec


@dataclasses.dataclass(frozen=True)
class InterHostLink:
    """The network between servers, per adapter; defaults and sources in the module docstring."""

    adapter_bw: float = 25e9  # bytes/s per adapter per direction (200 Gb/s HDR InfiniBand)
    adapters_per_host: int = 8  # DGX A100: one compute adapter per GPU
    efficiency: float = 0.9  # achieved all-reduce bus bandwidth / line rate, in (0, 1]
    latency_s: float = 20e-6  # seconds each all-reduce pays per server beyond the first

    def __post_init__(self) -> None:
        if not 0.0 < self.adapter_bw < float("inf"):
            raise ValueError(f"link.adapter_bw must be finite and > 0 (bytes/s), got {self.adapter_bw}")
        if self.adapters_per_host < 1:
            raise ValueError(f"link.adapters_per_host must be >= 1, got {self.adapters_per_host}")
        if not 0.0 < self.efficiency <= 1.0:
            raise ValueError(f"link.efficiency must be in (0, 1], got {self.efficiency}")
        if not 0.0 <= self.latency_s < float("inf"):
            raise ValueError(f"link.latency_s must be finite and >= 0, got {self.latency_s}")


def cross_host_cost(cost: CostModelConfig, gpu: GpuSpec, tp: int, hosts: int,
                    link: InterHostLink = InterHostLink()) -> CostModelConfig:
    """`cost` with its all-reduce constants for a `tp`-GPU group spread evenly over `hosts` servers.

    One server: `cost` unchanged. More: the ring's bus bandwidth becomes min(NVLink's measured,
    the adapters the group's GPUs of one server use x adapter_bw x efficiency), expressed through
    `nvlink_efficiency` (the cost model's bus bandwidth / NVLink bandwidth), and the floor and the
    fixed time each grow by (hosts - 1) x latency_s.
    """
    if hosts < 1 or tp % hosts:
        raise ValueError(f"hosts must be >= 1 and divide tp ({tp}), got {hosts}")
    if hosts == 1:
        return cost
    adapters = min(tp // hosts, link.adapters_per_host)  # rails: one per GPU of the group in a server
    bus = min(gpu.nvlink_bw * cost.nvlink_efficiency, adapters * link.adapter_bw * link.efficiency)
    extra = (hosts - 1) * link.latency_s
    return dataclasses.replace(cost, nvlink_efficiency=bus / gpu.nvlink_bw,
                               allreduce_floor_s=cost.allreduce_floor_s + extra,
                               allreduce_fixed_s=cost.allreduce_fixed_s + extra)
