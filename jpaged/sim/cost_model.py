"""Roofline cost of one serving step on a modeled GPU: the simulator's only source of time.

Per step and per GPU (tensor parallelism shards weights, heads and KV by `tp`):
- linear layers: max(weight bytes / bandwidth, GEMM FLOPs / compute) — decode is bandwidth-bound
  at small batches, prefill compute-bound;
- attention: max(KV bytes / bandwidth, attention FLOPs / compute); the paged decode kernel's
  measured overhead multiplies its KV read time;
- two all-reduces of the hidden state per layer over NVLink (Megatron), ring algorithm;
- fixed overheads: per layer (gaps between dependent kernels) and per step (host work).
Swap (PCIe) and copy-on-write (HBM) costs are separate so the executor can add them.
Activation traffic and elementwise FLOPs are left out: at the batch sizes served they are a few
percent of the weight and KV traffic, and the efficiency factors absorb them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jpaged.models.presets import ModelSpec, dtype_itemsize
from jpaged.sim.gpus import GpuSpec


@dataclasses.dataclass(frozen=True)
class CostModelConfig:
    """Efficiency factors and overheads; each is set from public measurements, not fitted."""

    # Achievable fraction of datasheet HBM bandwidth for large streaming reads: STREAM-like copies
    # reach ~1.3-1.4 of 1.555 TB/s on A100-40GB; the H200 device copy measures 4.3 of 4.8 TB/s.
    hbm_efficiency: float = 0.85
    # Fraction of dense FP16 peak the linear layers reach: cuBLAS reaches 70-80% on large GEMMs;
    # whole-layer inference MFU, with norms, activations and smaller shapes, is lower.
    gemm_efficiency: float = 0.6
    # Fraction of peak reached by prefill attention: FlashAttention-2 reports 50-73% of A100 peak in
    # the forward pass at long sequences; serving prompts are a few hundred tokens, so the low end.
    attention_efficiency: float = 0.5
    # Decode attention time of the paged kernel relative to a contiguous kernel at the same KV
    # bytes: the paper measures 20-26% higher attention latency than FasterTransformer (block-table
    # lookups, branches, variable lengths); replace with our kernel benchmark's measurement.
    paged_attention_overhead: float = 1.2
    # NCCL all-reduce bus bandwidth reaches ~80% of the per-direction NVLink bandwidth.
    nvlink_efficiency: float = 0.8
    # Latency of one small NCCL all-reduce over NVLink (launch + ring hops), seconds.
    allreduce_latency_s: float = 1.0e-5
    # GPU idle per layer between ~10 dependent kernels (~1.5 us each) without CUDA graphs, seconds.
    layer_overhead_s: float = 1.5e-5
    # Host work per step the GPU waits on (input upload, sampling, token readback), seconds.
    step_overhead_s: float = 1.0e-3
    # Setup cost of one host<->device copy (cudaMemcpyAsync + DMA setup, ~5-10 us), seconds. Swap
    # issues one copy per block per layer for K and for V, so small blocks swap slowly (Fig. 19).
    pcie_copy_latency_s: float = 5.0e-6

    def __post_init__(self) -> None:
        for name in ("hbm_efficiency", "gemm_efficiency", "attention_efficiency", "nvlink_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"cost.{name} must be in (0, 1], got {value}")
        if not self.paged_attention_overhead >= 1.0:
            raise ValueError(f"cost.paged_attention_overhead must be >= 1, got {self.paged_attention_overhead}")
        for name in ("allreduce_latency_s", "layer_overhead_s", "step_overhead_s", "pcie_copy_latency_s"):
            if getattr(self, name) < 0.0:
                raise ValueError(f"cost.{name} must be >= 0, got {getattr(self, name)}")


class CostModel:
    """Step times of one model on `tp` GPUs of one kind; per-model constants are computed once."""

    def __init__(self, spec: ModelSpec, gpu: GpuSpec, config: CostModelConfig = CostModelConfig(), *,
                 tp: int = 1, dtype: str = "float16", block_size: int = 16) -> None:
        if tp < 1 or spec.num_heads % tp:
            raise ValueError(f"tp must be >= 1 and divide num_heads ({spec.num_heads}), got {tp}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        itemsize = dtype_itemsize(dtype)
        h, f, layers = spec.hidden_size, spec.intermediate_size, spec.num_layers
        mlp_mats = 2 if spec.family == "opt" else 3  # OPT fc1 + fc2; LLaMA gate, up, down
        linear_params = layers * (2 * h * spec.q_size + 2 * h * spec.kv_size + mlp_mats * h * f)
        # GQA with tp > kv heads replicates KV heads: each GPU keeps at least one.
        kv_share = -(-spec.num_kv_heads // tp) / spec.num_kv_heads
        self.tp, self.num_layers, self.config = tp, layers, config
        self._bw = gpu.hbm_bw * config.hbm_efficiency  # bytes/s
        self._gemm_flops = gpu.fp16_flops * config.gemm_efficiency  # FLOP/s
        self._attn_flops = gpu.fp16_flops * config.attention_efficiency  # FLOP/s
        self._weight_time = spec.param_bytes(dtype) / tp / self._bw  # s, all weights read once per step
        self._flops_per_token = 2.0 * linear_params / tp  # FLOP, every token through every linear layer
        self._lm_head_flops = 2.0 * h * spec.vocab_size / tp  # FLOP per sampled row (vocab-parallel head)
        self.kv_bytes_per_token = spec.kv_bytes_per_token(dtype) * kv_share  # bytes on one GPU
        self.block_bytes = block_size * self.kv_bytes_per_token  # bytes of one KV block on one GPU
        self._kv_time_per_token = self.kv_bytes_per_token / self._bw  # s per context token read
        self._pair_flops = 4.0 * spec.q_size * layers / tp  # FLOP per (query, key) pair: QK^T and PV
        if tp == 1:
            self._comm_per_token, self._comm_fixed = 0.0, 0.0
        else:
            # Ring all-reduce moves 2 (tp - 1) / tp of the message per GPU; 2 per layer (attn, MLP).
            ring = 2.0 * (tp - 1) / tp / (gpu.nvlink_bw * config.nvlink_efficiency)
            self._comm_per_token = 2 * layers * h * itemsize * ring  # s per token in the batch
            self._comm_fixed = 2 * layers * config.allreduce_latency_s
        self._fixed = layers * config.layer_overhead_s + config.step_overhead_s + self._comm_fixed
        self._pcie_block_time = self.block_bytes / gpu.pcie_bw + 2 * layers * config.pcie_copy_latency_s

    def _linear_time(self, num_tokens: int, num_seqs: int) -> float:
        flops = num_tokens * self._flops_per_token + num_seqs * self._lm_head_flops
        return max(self._weight_time, flops / self._gemm_flops)

    def decode_time(self, context_lens: np.ndarray) -> float:
        """Seconds of a decode step: one new token per sequence; `context_lens` i32[B] after the write."""
        num_seqs = len(context_lens)
        return self.decode_time_from_sums(num_seqs, int(context_lens.sum()))

    def decode_time_from_sums(self, num_seqs: int, context_tokens: int) -> float:
        """`decode_time` given the batch size and the total context tokens of the batch."""
        if num_seqs == 0:
            return 0.0
        attn = max(context_tokens * self._kv_time_per_token * self.config.paged_attention_overhead,
                   context_tokens * self._pair_flops / self._attn_flops)
        return (self._linear_time(num_seqs, num_seqs) + attn
                + num_seqs * self._comm_per_token + self._fixed)

    def prefill_time(self, query_lens: np.ndarray, context_lens: np.ndarray) -> float:
        """Seconds of a prefill step: sequence i computes its last query_lens[i] of context_lens[i] tokens.

        A query at position p attends to p + 1 keys (causal, offset by the cached prefix), so a
        sequence contributes q (c - q) + q (q + 1) / 2 (query, key) pairs.
        """
        num_seqs = len(query_lens)
        if num_seqs == 0:
            return 0.0
        q = query_lens.astype(np.float64)
        num_tokens = int(query_lens.sum())
        pairs = float((q * (context_lens - q) + 0.5 * q * (q + 1)).sum())
        attn = max(pairs * self._pair_flops / self._attn_flops,
                   float(context_lens.sum()) * self._kv_time_per_token)
        return (self._linear_time(num_tokens, num_seqs) + attn
                + num_tokens * self._comm_per_token + self._fixed)

    def swap_time(self, num_blocks: int) -> float:
        """Seconds to move `num_blocks` KV blocks between host and device over PCIe (one direction)."""
        return num_blocks * self._pcie_block_time

    def copy_time(self, num_blocks: int) -> float:
        """Seconds to copy `num_blocks` KV blocks on the device (copy-on-write): read + write each."""
        return num_blocks * 2.0 * self.block_bytes / self._bw
