"""Cost of one serving step on a modeled GPU: the simulator's only source of time.

`step_time(query_lens, context_lens)` times any batch mix (decode rows have query 1; prefill and
chunked-prefill rows many; a row's queries are the last tokens of its context). Per GPU, with
tensor parallelism sharding weights, heads and KV by `tp`, a step is the sum of:
- GEMMs: the four projections of every layer over all the step's tokens, plus the LM head over one
  row per sequence (per token in a speculative verify step): kernel_s each + (weight read^p +
  FLOPs^p)^(1/p), a roofline whose sharpness p is measured (memory-bound at small batches,
  compute-bound at large);
- elementwise kernels (norms, activation, residual adds, RoPE): per layer, max(launch floor,
  activation bytes / achieved bandwidth);
- attention: decode rows read their KV (the paged kernel's overhead multiplies the read), prefill
  rows are max(causal attention FLOPs, KV read); every new token's K/V is written;
- two all-reduces of the step's hidden states per layer (Megatron), measured NCCL times vs bytes;
- vLLM's host (CPU) work per step, measured as a line in the batch size per TP degree.
The GPU parts run back to back after the host part, as in vLLM of the paper's era (no overlap).
Every default constant comes from `jpaged/paper/sim/vidur_a100_fit.json`, fitted by `fit_vidur` on
Vidur's measurements of vLLM on A100 (docs/notes/simulator.md), except the
two attention factors, which those measurements do not cover. Swap (PCIe) and copy-on-write (HBM)
costs are separate so the executor can add them.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jpaged.config.presets import ModelSpec, dtype_itemsize
from jpaged.paper.sim.gpus import GpuSpec
from jpaged.paper.sim.measured import VIDUR_A100
from jpaged.paper.sim.shapes import GEMMS_PER_LAYER, elementwise_elements_per_token, gemm_params_per_layer

_FIT = VIDUR_A100
PARTS = ("gemm", "elementwise", "attention", "communication", "host")  # keys of `CostModel.breakdown`


@dataclasses.dataclass(frozen=True)
class CostModelConfig:
    """Efficiencies and overheads. Defaults: the committed fit on Vidur's A100 data, unless noted."""

    # Achieved fraction of datasheet HBM bandwidth (weights, KV, copies): GEMMs at <= 16 tokens
    # read their weights at 1.69 of the A100-80GB PCIe's 1.935 TB/s (mlp_llama2_7b.csv, TP 1).
    hbm_efficiency: float = _FIT.hbm_efficiency
    # Achieved fraction of dense FP16 tensor-core peak: GEMMs at >= 1024 tokens reach 220 of 312 TFLOP/s.
    tensor_core_efficiency: float = _FIT.tensor_core_efficiency
    # Fixed seconds per GEMM kernel (start-up and tail), fitted on all TP 1 GEMM points.
    gemm_kernel_s: float = _FIT.gemm_kernel_s
    # p of (memory^p + compute^p)^(1/p): how gradually GEMMs turn compute-bound (large p: a sharp max).
    roofline_exponent: float = _FIT.roofline_exponent
    # Achieved fraction of HBM bandwidth of the elementwise kernels over their activation bytes.
    elementwise_efficiency: float = _FIT.elementwise_efficiency
    # Seconds per layer the elementwise kernels take at least (launch-bound at small batches).
    elementwise_floor_s: float = _FIT.elementwise_floor_s
    # Not measured by Vidur's files: fraction of peak reached by prefill attention; FlashAttention-2
    # reports 50-73% of A100 peak in the forward pass at long sequences, prompts are short: the low end.
    attention_efficiency: float = 0.5
    # Not measured by Vidur's files: decode attention time of the paged kernel relative to a
    # contiguous kernel at the same KV bytes; the paper measures 20-26% above FasterTransformer's.
    paged_attention_overhead: float = 1.2
    # All-reduce bus bandwidth / per-direction NVLink bandwidth: 192 of 300 GB/s on the measured
    # NVLink pair (all_reduce_pairwise_nvlink.csv, 2 GPUs); NVSwitch servers run each ring hop on NVLink.
    nvlink_efficiency: float = _FIT.nvlink_efficiency
    # Seconds one all-reduce takes at least, however small (measured median plateau, 2 GPUs).
    allreduce_floor_s: float = _FIT.allreduce_floor_s
    # Fixed seconds of a bandwidth-bound all-reduce: t = max(floor, fixed + ring bytes / bus bandwidth).
    allreduce_fixed_s: float = _FIT.allreduce_fixed_s
    # Host seconds per step at batch 0; None: the measured line of the model's TP degree (cpu_overheads.csv).
    host_overhead_s: float | None = None
    # Host seconds per sequence in the step; None: the measured line of the model's TP degree.
    host_overhead_per_seq_s: float | None = None
    # Setup cost of one host<->device copy (cudaMemcpyAsync + DMA setup, ~5-10 us), seconds. Swap
    # issues one copy per block per layer for K and for V, so small blocks swap slowly (Fig. 19).
    pcie_copy_latency_s: float = 5.0e-6

    def __post_init__(self) -> None:
        for name in ("hbm_efficiency", "tensor_core_efficiency", "elementwise_efficiency",
                     "attention_efficiency", "nvlink_efficiency"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"cost.{name} must be in (0, 1], got {value}")
        if not self.paged_attention_overhead >= 1.0:
            raise ValueError(f"cost.paged_attention_overhead must be >= 1, got {self.paged_attention_overhead}")
        if not 1.0 <= self.roofline_exponent < float("inf"):
            raise ValueError(f"cost.roofline_exponent must be finite and >= 1, got {self.roofline_exponent}")
        for name in ("gemm_kernel_s", "elementwise_floor_s", "allreduce_floor_s", "allreduce_fixed_s",
                     "host_overhead_s", "host_overhead_per_seq_s", "pcie_copy_latency_s"):
            value = getattr(self, name)
            if value is not None and not value >= 0.0:
                raise ValueError(f"cost.{name} must be >= 0, got {value}")


class CostModel:
    """Step times of one model on `tp` GPUs of one kind; per-model constants are computed once."""

    def __init__(self, spec: ModelSpec, gpu: GpuSpec, config: CostModelConfig = CostModelConfig(), *,
                 tp: int = 1, dtype: str = "float16", block_size: int = 16) -> None:
        if tp < 1 or spec.num_heads % tp:
            raise ValueError(f"tp must be >= 1 and divide num_heads ({spec.num_heads}), got {tp}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        c, itemsize, layers, h = config, dtype_itemsize(dtype), spec.num_layers, spec.hidden_size
        self.tp, self.num_layers, self.config = tp, layers, c
        self._bw = gpu.hbm_bw * c.hbm_efficiency  # bytes/s
        flops = gpu.fp16_flops * c.tensor_core_efficiency  # FLOP/s
        self._p = c.roofline_exponent
        layer_params = sum(gemm_params_per_layer(spec, tp))  # GEMM weights of one layer on one GPU
        self._gemm_mem_s = layers * layer_params * itemsize / self._bw  # weights read once per step
        self._gemm_s_per_token = 2.0 * layers * layer_params / flops  # every token through every GEMM
        head_params = spec.vocab_size * h / tp  # vocabulary-parallel LM head, one row per sequence
        self._head_mem_s = head_params * itemsize / self._bw
        self._head_s_per_row = 2.0 * head_params / flops
        self._gemm_fixed_s = (layers * GEMMS_PER_LAYER + 1) * c.gemm_kernel_s
        self._elem_s_per_token = (elementwise_elements_per_token(spec, tp) * itemsize
                                  / (gpu.hbm_bw * c.elementwise_efficiency))  # per layer
        # GQA with tp > kv heads replicates KV heads: each GPU keeps at least one.
        kv_share = -(-spec.num_kv_heads // tp) / spec.num_kv_heads
        self.kv_bytes_per_token = spec.kv_bytes_per_token(dtype) * kv_share  # bytes on one GPU
        self.block_bytes = block_size * self.kv_bytes_per_token  # bytes of one KV block on one GPU
        self._kv_s_per_token = self.kv_bytes_per_token / self._bw  # s per context token read or written
        self._decode_kv_s = self._kv_s_per_token * c.paged_attention_overhead
        self._pair_s = 4.0 * spec.q_size * layers / tp / (gpu.fp16_flops * c.attention_efficiency)  # QK^T, PV
        # Ring all-reduce: each GPU sends 2 (tp - 1) / tp of the message; 2 per layer (attention, MLP).
        self._num_allreduce = 2 * layers if tp > 1 else 0
        ring = 2.0 * (tp - 1) / tp
        self._allreduce_s_per_token = ring * h * itemsize / (gpu.nvlink_bw * c.nvlink_efficiency)
        line = _FIT.host_overhead(tp)
        self._host_fixed_s = line.fixed_s if c.host_overhead_s is None else c.host_overhead_s
        self._host_per_seq_s = line.per_seq_s if c.host_overhead_per_seq_s is None else c.host_overhead_per_seq_s
        self._pcie_block_s = self.block_bytes / gpu.pcie_bw + 2 * layers * c.pcie_copy_latency_s

    def _roofline(self, memory_s: float, compute_s: float) -> float:
        p = self._p
        return (memory_s**p + compute_s**p) ** (1.0 / p)

    def _attention(self, query_lens: np.ndarray, context_lens: np.ndarray, num_tokens: int,
                   verify: bool = False) -> float:
        write = num_tokens * self._kv_s_per_token
        decode = query_lens == 1
        if decode.all():  # a decode row's queries see c keys: its (query, key) pairs equal its context
            return write + float(context_lens.sum()) * max(self._decode_kv_s, self._pair_s)
        # A query at position p attends to p + 1 keys (causal, offset by the cached context), so a
        # row computing its last q of c tokens has q (c - q) + q (q + 1) / 2 (query, key) pairs.
        q = query_lens[~decode].astype(np.float64)
        ctx = context_lens[~decode]
        pairs = float((q * (ctx - q) + 0.5 * q * (q + 1)).sum())
        # Verify rows read their cached context through the paged kernel, as decode rows do.
        read_s = self._decode_kv_s if verify else self._kv_s_per_token
        prefill = max(pairs * self._pair_s, float(ctx.sum()) * read_s)
        return write + prefill + float(context_lens[decode].sum()) * max(self._decode_kv_s, self._pair_s)

    def _parts(self, query_lens: np.ndarray, context_lens: np.ndarray, verify: bool = False) -> tuple[float, ...]:
        num_seqs = len(query_lens)
        if num_seqs == 0:
            return (0.0,) * len(PARTS)
        num_tokens = int(query_lens.sum())
        c = self.config
        head_rows = num_tokens if verify else num_seqs  # verify: every query token's logits
        gemm = (self._gemm_fixed_s + self._roofline(self._gemm_mem_s, num_tokens * self._gemm_s_per_token)
                + self._roofline(self._head_mem_s, head_rows * self._head_s_per_row))
        elementwise = self.num_layers * max(c.elementwise_floor_s, num_tokens * self._elem_s_per_token)
        comm = self._num_allreduce * max(c.allreduce_floor_s,
                                         c.allreduce_fixed_s + num_tokens * self._allreduce_s_per_token)
        host = self._host_fixed_s + self._host_per_seq_s * num_seqs
        return gemm, elementwise, self._attention(query_lens, context_lens, num_tokens, verify), comm, host

    def step_time(self, query_lens: np.ndarray, context_lens: np.ndarray, *, verify: bool = False) -> float:
        """Seconds of one step: row i computes the last query_lens[i] of its context_lens[i] tokens.

        `query_lens`, `context_lens`: i32[B], context counted after the step's writes, 1 <=
        query_lens[i] <= context_lens[i]; decode rows have query 1. An empty batch costs 0.
        `verify`: a speculative verify step (jpaged.paper.sim.speculative): every query token goes
        through the LM head (not only each row's last), and rows of several queries read their
        cached context at the paged decode kernel's cost, not at a prefill's.
        """
        return sum(self._parts(query_lens, context_lens, verify))

    def breakdown(self, query_lens: np.ndarray, context_lens: np.ndarray, *, verify: bool = False) -> dict[str, float]:
        """`step_time`'s seconds by part (`PARTS`: gemm, elementwise, attention, communication, host)."""
        return dict(zip(PARTS, self._parts(query_lens, context_lens, verify)))

    def decode_time(self, context_lens: np.ndarray) -> float:
        """Seconds of a decode step: one new token per sequence; `context_lens` i32[B] after the write."""
        return self.step_time(np.ones(len(context_lens), np.int32), context_lens)

    def prefill_time(self, query_lens: np.ndarray, context_lens: np.ndarray) -> float:
        """Seconds of a prefill step; the same as `step_time` (kept for callers that split the two)."""
        return self.step_time(query_lens, context_lens)

    def swap_time(self, num_blocks: int) -> float:
        """Seconds to move `num_blocks` KV blocks between host and device over PCIe (one direction)."""
        return num_blocks * self._pcie_block_s

    def copy_time(self, num_blocks: int) -> float:
        """Seconds to copy `num_blocks` KV blocks on the device (copy-on-write): read + write each."""
        return num_blocks * 2.0 * self.block_bytes / self._bw
