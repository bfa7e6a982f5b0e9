"""The simulator's step times against Vidur's measurements of vLLM on A100 (issue: grounded simulator).

Compares, at the measured points, the cost model (jpaged/paper/sim/cost_model.py, constants fitted by
jpaged/paper/sim/fit_vidur.py) with ../shared/data/vidur_a100 (Vidur, MIT licence; measured on an
A100-80GB PCIe, see fit_vidur):
- decode step of Llama-2-7B at batch 8-64, TP 1 and 2: 32 layers of the measured GEMM and
  elementwise kernels + the measured host work + (TP 2) 64 measured all-reduces, against the
  same parts simulated. Attention and the LM head are left out of both: Vidur's files measure
  neither. The ratio per batch size is simulated / measured.
- each part on its own: GEMMs and elementwise kernels per layer by token count and TP degree,
  host work per step by model, TP degree and batch, all-reduce time by message size.
- OPT-13B decode step times on an A100-40GB (the paper's Fig. 12 server) and their breakdown.
- the memory-bound number of resident requests of each throughput panel, beside its max_num_seqs.

    python -m experiments.sim_validation --config configs/sim_validation.yaml
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import yaml

from experiments import common
from experiments.common import REPO_ROOT, provenance, write_json
from jpaged.config.presets import get_preset
from jpaged.paper.sim import fit_vidur
from jpaged.paper.sim.cost_model import CostModel
from jpaged.paper.sim.gpus import get_gpu
from jpaged.paper.workloads import sample_lengths

logger = logging.getLogger(__name__)
LLAMA_LAYERS = 32


@dataclasses.dataclass(frozen=True)
class SimValidationConfig:
    """The measured points to compare at, and the OPT-13B and panel summaries."""

    data_dir: str = "../shared/data/vidur_a100"  # Vidur's CSVs, relative to the repo root
    decode_batches: list[int] = dataclasses.field(default_factory=lambda: [8, 16, 24, 32, 40, 48, 56, 64])
    decode_tps: list[int] = dataclasses.field(default_factory=lambda: [1, 2])  # composite step (NVLink pair at 2)
    layer_tokens: list[int] = dataclasses.field(
        default_factory=lambda: [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])  # per-layer kernel points
    all_reduce_bytes: list[int] = dataclasses.field(
        default_factory=lambda: [2**16, 2**18, 2**20, 2**22, 2**24, 2**26, 2**28])  # nearest measured sizes
    opt13b_batches: list[int] = dataclasses.field(default_factory=lambda: [8, 32, 64, 128, 256])
    opt13b_contexts: list[int] = dataclasses.field(default_factory=lambda: [64, 320])  # per sequence
    panels: list[str] = dataclasses.field(default_factory=lambda: [
        f"configs/throughput_{m}_{d}.yaml" for m in ("opt13b", "opt66b", "opt175b") for d in ("sharegpt", "alpaca")])
    capacity_samples: int = 200_000  # sampled requests per dataset for the resident-request estimate
    seed: int = 0  # seeds the length samples
    output: str = "results/sim_validation.json"  # results JSON, relative to the repo root

    def __post_init__(self) -> None:
        for name in ("decode_batches", "decode_tps", "layer_tokens", "all_reduce_bytes", "opt13b_batches",
                     "opt13b_contexts"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be a non-empty list of integers >= 1, got {values}")
        if self.capacity_samples < 1000:
            raise ValueError(f"capacity_samples must be >= 1000, got {self.capacity_samples}")


def _at(table: dict[str, np.ndarray], column: str, **where: float) -> float:
    """Median of `column` over the rows matching every `where` (the CSVs repeat some points)."""
    rows = np.ones(len(table[column]), bool)
    for key, value in where.items():
        rows &= table[key] == value
    if not rows.any():
        raise ValueError(f"no measured row with {where}")
    return float(np.median(table[column][rows]))


def _layer_models(tp: int) -> CostModel:
    """Llama-2-7B without an LM head (Vidur's layer profile has none) on the measured GPU."""
    spec = dataclasses.replace(get_preset("llama-7b"), vocab_size=1)
    return CostModel(spec, get_gpu(fit_vidur.MEASURED_GPU), tp=tp)


def layer_parts(mlp: dict, tokens: list[int], tps: list[int]) -> list[dict]:
    """Per-layer GEMM and elementwise seconds, simulated and measured, by token count and TP."""
    points = []
    for tp in tps:
        model = _layer_models(tp)
        for n in tokens:
            q = np.ones(n, np.int32)
            parts = model.breakdown(q, q)
            sim_gemm = (parts["gemm"] - model.config.gemm_kernel_s) / LLAMA_LAYERS  # less the 1-word head
            sim_elem = parts["elementwise"] / LLAMA_LAYERS
            where = {"num_tokens": n, "num_tensor_parallel_workers": tp}
            gemm = sum(_at(mlp, f"time_stats.{op}.median", **where) for op in fit_vidur.GEMM_OPS) * 1e-3
            elem = sum(_at(mlp, f"time_stats.{op}.median", **where) for op in fit_vidur.ELEMENTWISE_OPS) * 1e-3
            points.append({"tp": tp, "tokens": n, "gemm_sim_s": sim_gemm, "gemm_measured_s": gemm,
                           "gemm_ratio": sim_gemm / gemm, "elementwise_sim_s": sim_elem,
                           "elementwise_measured_s": elem, "elementwise_ratio": sim_elem / elem})
    return points


def host_parts(cpu: dict) -> list[dict]:
    """Host seconds per step, simulated (the fitted line) and measured, at every measured point."""
    measured = fit_vidur.host_overhead_ms(cpu) * 1e-3
    points = []
    for i in range(len(measured)):
        tp, batch, name = int(cpu["tensor_parallel_degree"][i]), int(cpu["batch_size"][i]), str(cpu["model_name"][i])
        sim = _layer_models(tp).breakdown(np.ones(batch, np.int32), np.ones(batch, np.int32))["host"]
        points.append({"model": name, "tp": tp, "batch": batch, "fitted_on": name in fit_vidur.HOST_MODELS,
                       "sim_s": sim, "measured_s": float(measured[i]), "ratio": sim / float(measured[i])})
    return points


def _measured_all_reduce(ar: dict, workers: int, size: float) -> float:
    rows = ar["num_workers"] == workers
    order = np.argsort(ar["size"][rows])
    return float(np.interp(size, ar["size"][rows][order], ar["time_stats.all_reduce.median"][rows][order])) * 1e-3


def all_reduce_parts(ar: dict, sizes: list[int]) -> list[dict]:
    """One all-reduce on 2 GPUs, simulated and measured, at the measured sizes nearest `sizes`."""
    model = _layer_models(2)
    h_bytes = 4096 * 2  # one Llama-2-7B token's hidden state, fp16
    points = []
    for size in sizes:
        tokens = max(1, round(size / h_bytes))
        q = np.ones(tokens, np.int32)
        sim = model.breakdown(q, q)["communication"] / (2 * LLAMA_LAYERS)
        measured = _measured_all_reduce(ar, 2, tokens * h_bytes)
        points.append({"bytes": tokens * h_bytes, "sim_s": sim, "measured_s": measured, "ratio": sim / measured})
    return points


def decode_steps(mlp: dict, cpu: dict, ar: dict, batches: list[int], tps: list[int]) -> list[dict]:
    """Llama-2-7B decode steps without attention and LM head: simulated vs Vidur's measured parts."""
    host = fit_vidur.host_overhead_ms(cpu) * 1e-3
    points = []
    for tp in tps:
        model = _layer_models(tp)
        for batch in batches:
            q = np.ones(batch, np.int32)
            parts = model.breakdown(q, q)
            sim = parts["gemm"] - model.config.gemm_kernel_s + parts["elementwise"] + parts["communication"] + parts["host"]
            where = {"num_tokens": batch, "num_tensor_parallel_workers": tp}
            layer = sum(_at(mlp, f"time_stats.{op}.median", **where)
                        for op in (*fit_vidur.GEMM_OPS, *fit_vidur.ELEMENTWISE_OPS)) * 1e-3
            rows = (cpu["model_name"] == "meta-llama/Llama-2-7b-hf") & (cpu["tensor_parallel_degree"] == tp) \
                & (cpu["batch_size"] == batch)
            comm = 2 * LLAMA_LAYERS * _measured_all_reduce(ar, tp, batch * 4096 * 2) if tp > 1 else 0.0
            measured = LLAMA_LAYERS * layer + float(host[rows][0]) + comm
            points.append({"tp": tp, "batch": batch, "sim_s": sim, "measured_s": measured, "ratio": sim / measured,
                           "sim_host_s": parts["host"], "measured_host_s": float(host[rows][0])})
    return points


def opt13b_steps(batches: list[int], contexts: list[int]) -> list[dict]:
    """OPT-13B decode steps on one A100-40GB: total seconds and the breakdown by part."""
    model = CostModel(get_preset("opt-13b"), get_gpu("a100-40gb"))
    points = []
    for context in contexts:
        for batch in batches:
            parts = model.breakdown(np.ones(batch, np.int32), np.full(batch, context, np.int32))
            points.append({"batch": batch, "context": context, "step_s": sum(parts.values()),
                           **{f"{k}_s": v for k, v in parts.items()}})
    return points


def _blocks_up_to(n: np.ndarray, block: int) -> np.ndarray:
    """sum_{k=1..n} ceil(k / block), elementwise: block q (q + 1) / 2 + r (q + 1) for n = q block + r."""
    q, r = np.divmod(n, block)
    return block * q * (q + 1) // 2 + r * (q + 1)


def panel_capacity(panel_paths: list[str], samples: int, seed: int) -> list[dict]:
    """Memory-bound resident requests of each panel: KV slots over a request's time-averaged blocks.

    A request of prompt p and output o holds ceil((p + t) / block) blocks during its t-th decode
    step; by Little's law the pool sustains slots x E[o] / E[sum_t block x ceil((p + t) / block)]
    requests on average (each decode step weighted alike, prefill ignored).
    """
    rng = np.random.default_rng(seed)
    lengths = {d: sample_lengths(d, samples, rng) for d in ("sharegpt", "alpaca")}
    points = []
    for path in panel_paths:
        panel = yaml.safe_load((REPO_ROOT / path).read_text())
        block, blocks = panel["cache"]["block_size"], panel["cache"]["num_blocks"]
        prompt, output = lengths[panel["dataset"]]
        held = block * (_blocks_up_to(prompt + output, block) - _blocks_up_to(prompt, block))  # slot-steps
        slots = (blocks - 1) * block
        capacity = slots * output.mean() / held.mean()
        points.append({"panel": path, "model": panel["model"]["name"], "dataset": panel["dataset"],
                       "tp": panel["sim"]["tp"], "kv_slots": slots, "max_num_seqs": panel["scheduler"]["max_num_seqs"],
                       "memory_bound_resident_requests": float(capacity),
                       "cap_binds": bool(capacity > panel["scheduler"]["max_num_seqs"])})
    return points


def _summary(points: list[dict], key: str = "ratio") -> dict[str, float]:
    ratios = np.array([p[key] for p in points])
    return {"min": float(ratios.min()), "median": float(np.median(ratios)), "max": float(ratios.max())}


def run(config: SimValidationConfig) -> dict:
    """Runs every comparison and writes the results JSON."""
    data = (REPO_ROOT / config.data_dir).resolve()
    if not data.is_dir():
        raise FileNotFoundError(f"data_dir {data} is absent: it holds Vidur's CSVs (../shared/data/vidur_a100)")
    mlp = fit_vidur.read_csv(data / "mlp_llama2_7b.csv")
    cpu = fit_vidur.read_csv(data / "cpu_overheads.csv")
    ar = fit_vidur.read_csv(data / "all_reduce_pairwise_nvlink.csv")
    decode = decode_steps(mlp, cpu, ar, config.decode_batches, config.decode_tps)
    layers = layer_parts(mlp, config.layer_tokens, [1, 2, 4, 8])
    host = host_parts(cpu)
    all_reduce = all_reduce_parts(ar, config.all_reduce_bytes)
    result = {
        "provenance": provenance(config, seed=config.seed, device="none (cost model)"),
        "summary": {"decode_step_ratio": _summary(decode),
                    "gemm_ratio_tp1": _summary([p for p in layers if p["tp"] == 1], "gemm_ratio"),
                    "gemm_ratio_tp2_4_8": _summary([p for p in layers if p["tp"] > 1], "gemm_ratio"),
                    "elementwise_ratio": _summary(layers, "elementwise_ratio"),
                    "host_ratio_fitted_models": _summary([p for p in host if p["fitted_on"]]),
                    "host_ratio_codellama_34b": _summary([p for p in host if not p["fitted_on"]]),
                    "all_reduce_ratio": _summary(all_reduce)},
        "decode_steps": decode, "layer_parts": layers, "host": host, "all_reduce": all_reduce,
        "opt13b_decode": opt13b_steps(config.opt13b_batches, config.opt13b_contexts),
        "panel_capacity": panel_capacity(config.panels, config.capacity_samples, config.seed),
    }
    path = write_json(REPO_ROOT / config.output, result)
    print(markdown(result))
    logger.info("wrote %s", path)
    return result


def markdown(result: dict) -> str:
    """The REPORT section's tables: decode-step ratio per batch size, and the summaries."""
    lines = ["| TP | batch | simulated ms | measured ms | ratio |", "|---|---|---|---|---|"]
    lines += [f"| {p['tp']} | {p['batch']} | {p['sim_s'] * 1e3:.2f} | {p['measured_s'] * 1e3:.2f} | {p['ratio']:.3f} |"
              for p in result["decode_steps"]]
    lines += ["", "| comparison | min | median | max |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['min']:.3f} | {v['median']:.3f} | {v['max']:.3f} |" for k, v in result["summary"].items()]
    return "\n".join(lines)


def main() -> None:
    """The command line: `python -m experiments.sim_validation [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.split("\n")[0], SimValidationConfig, run, "configs/sim_validation.yaml")
