"""Normalized latency of vLLM vs KV block size at a fixed request rate (paper Fig. 18b).

For each dataset and block size the KV pool keeps the same number of token slots (15.7K for
OPT-13B on an A100-40GB), so only the granularity changes: larger blocks waste more slots at the
tail of each sequence (fewer sequences fit), smaller ones make the paged kernel do more,
smaller reads. The kernel's cost at a block size comes from the kernel benchmark
(`results/kernel_bench.json`, Fig. 18a): the median paged/contiguous attention time over its
rows of that block size, GPU rows preferred where there are any; block sizes the benchmark did
not time use `sim.cost.paged_attention_overhead`. Each point records which source it used.

    python -m experiments.block_size --config configs/block_size.yaml [--resume]
"""

from __future__ import annotations

import dataclasses
import json
import logging

import matplotlib.pyplot as plt
import numpy as np

from experiments import common, plots
from experiments.common import REPO_ROOT, provenance, write_json
from experiments.serving import point_metrics, run_sweep
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, config_to_dict
from jpaged.config.presets import get_preset
from jpaged.paper.sim.config import SimConfig
from jpaged.paper.systems import build_engine
from jpaged.paper.trace_runner import run_trace
from jpaged.paper.workloads import WorkloadConfig, generate_trace

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BlockSizeConfig:
    """The block sizes, the rate per dataset and where the kernel costs come from."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="opt-13b"))  # served model
    block_sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])
    rates: dict[str, float] = dataclasses.field(default_factory=dict)  # dataset -> the fixed request rate (req/s)
    kv_slots: int = 15728  # token slots of the pool at every block size (Table 1: OPT-13B, A100-40GB)
    duration_s: float = 300.0  # trace length per point, seconds
    seed: int = 0  # seeds every trace (the same for every block size)
    kernel_bench: list[str] = dataclasses.field(default_factory=lambda: ["results/kernel_bench.json"])  # JSONs with rows
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)  # modeled GPUs; its cost's overhead is the fallback
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)  # batch limits
    output: str = "results/block_size.json"  # results JSON, relative to the repo root
    figure: str = "results/block_size.png"  # Fig. 18b

    def __post_init__(self) -> None:
        if not self.block_sizes or any(b < 1 or b & (b - 1) for b in self.block_sizes):
            raise ValueError(f"block_sizes must be powers of two >= 1, got {self.block_sizes}")
        if not self.rates:
            raise ValueError("rates must map at least one dataset ('sharegpt', 'alpaca') to a rate")
        for dataset, rate in self.rates.items():
            if dataset not in ("sharegpt", "alpaca") or not 0 < rate < float("inf"):
                raise ValueError(f"rates.{dataset}: dataset must be sharegpt or alpaca and the rate finite "
                                 f"and > 0 (req/s), got {rate}")
        if self.kv_slots < max(self.block_sizes):
            raise ValueError(f"kv_slots must be >= the largest block size, got {self.kv_slots}")


def kernel_overheads(paths: list[str]) -> tuple[dict[int, float], str]:
    """Paged/contiguous attention time per block size from kernel-benchmark rows, and their device.

    Rows of a GPU are used when any file has them, else CPU rows; per block size the median
    ratio, floored at 1 (the cost model never makes paged attention faster than contiguous).
    """
    rows = []
    for path in paths:
        full = REPO_ROOT / path
        if full.exists():
            rows += json.loads(full.read_text()).get("rows", [])
    gpu = [r for r in rows if r.get("device") not in (None, "cpu")]
    use, device = (gpu, gpu[0]["device"]) if gpu else (rows, "cpu" if rows else "none")
    by_size: dict[int, list[float]] = {}
    for r in use:
        by_size.setdefault(int(r["block_size"]), []).append(float(r["paged_over_contiguous"]))
    return {b: max(1.0, float(np.median(v))) for b, v in sorted(by_size.items())}, device


def run_point(config: BlockSizeConfig, dataset: str, block_size: int, overheads: dict[int, float],
              device: str) -> dict:
    """Serves the dataset's trace at its rate with vLLM at `block_size`."""
    overhead = overheads.get(block_size, config.sim.cost.paged_attention_overhead)
    sim = dataclasses.replace(config.sim, cost=dataclasses.replace(config.sim.cost, paged_attention_overhead=overhead))
    cache = CacheConfig(block_size=block_size, num_blocks=config.kv_slots // block_size + 1,
                        num_host_blocks=config.kv_slots // block_size)
    engine = build_engine("vllm", EngineConfig(model=config.model, cache=cache, scheduler=config.scheduler,
                                               executor="sim"), sim)
    trace = generate_trace(WorkloadConfig(dataset=dataset, request_rate=config.rates[dataset],
                                          duration_s=config.duration_s, seed=config.seed),
                           vocab_size=get_preset(config.model.name).vocab_size)
    result = run_trace(engine, trace)
    return {"dataset": dataset, "block_size": block_size, "request_rate": config.rates[dataset],
            "paged_attention_overhead": overhead,
            "overhead_source": f"kernel_bench ({device})" if block_size in overheads else "config default",
            **point_metrics(result)}


def _settings(config: BlockSizeConfig) -> dict:
    settings = config_to_dict(config)
    for key in ("block_sizes", "output", "figure"):
        settings.pop(key)
    return settings


def run(config: BlockSizeConfig, resume: bool = False) -> dict:
    """Runs the sweep (under `resume`, only the points the output JSON lacks); writes the JSON and the
    figure; returns the JSON."""
    overheads, device = kernel_overheads(config.kernel_bench)
    keys = [(d, b) for d in config.rates for b in config.block_sizes]
    prov = provenance(config, seed=config.seed, device=f"simulated {config.sim.tp}x {config.sim.gpu}")
    settings = _settings(config) | {"kernel_overheads": {str(b): v for b, v in overheads.items()}}
    points = run_sweep(REPO_ROOT / config.output, settings, keys, lambda p: (p["dataset"], p["block_size"]),
                       lambda k: run_point(config, *k, overheads, device), prov, "block size sweep", resume=resume)
    best = {d: min((p for p in points if p["dataset"] == d), key=lambda p: p["normalized_latency"])["block_size"]
            for d in config.rates}
    result = {"points": points, "best_block_size": best, "kernel_overheads": settings["kernel_overheads"],
              "kernel_overhead_device": device, "total_wall_s": sum(p["wall_s"] for p in points),
              "settings": settings, "provenance": prov}
    write_json(REPO_ROOT / config.output, result)
    fig, axes = plt.subplots(1, len(config.rates), figsize=(4.0 * len(config.rates), 3.2), squeeze=False)
    for ax, dataset in zip(axes[0], config.rates):
        pts = [p for p in points if p["dataset"] == dataset]
        ax.bar(range(len(pts)), [p["normalized_latency"] for p in pts], color="tab:red")
        ax.set_xticks(range(len(pts)), [str(p["block_size"]) for p in pts])
        ax.set_xlabel("Block size (tokens)")
        ax.set_ylabel("Normalized latency (s/token)")
        ax.set_title(f"{dataset} at {config.rates[dataset]} req/s", fontsize=9)
    fig.suptitle(f"vLLM, {config.model.name}, {config.sim.tp}x {config.sim.gpu} (simulated), "
                 f"kernel costs: {device}", fontsize=9)
    fig.tight_layout()
    plots.save(fig, REPO_ROOT / config.figure)
    for p in points:
        print(f"{p['dataset']:<9} block_size {p['block_size']:>3}  normalized_latency {p['normalized_latency']:.4f}  "
              f"overhead {p['paged_attention_overhead']:.2f} ({p['overhead_source']})")
    print("best_block_size " + "  ".join(f"{d}: {b}" for d, b in best.items()))
    return result


def main() -> None:
    """The command line: `python -m experiments.block_size [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], BlockSizeConfig, run, "configs/block_size.yaml")
