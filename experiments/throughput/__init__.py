"""Normalized latency vs request rate for the five systems (paper Figs. 12 and 13).

For each system and request rate, a Poisson trace (the same trace for every system at a rate)
runs through that system's engine; the point records the paper's normalized latency, vLLM's
benchmark metrics and both batch sizes of Fig. 13 (jpaged/paper/metrics.py BatchOccupancyAccumulator:
requests resident in the KV cache, and requests per step). The sustained rate of a system is where its
normalized latency crosses `latency_threshold_factor` times the lowest normalized latency of the
sweep (the unloaded per-token latency): linear interpolation between the last rate under it and
the first over it. A plain run computes every point; `--resume` keeps the points of the output
JSON made with the same settings and computes the rest (`experiments/serving.py`: each point
carries the provenance of the run that computed it). `executor: jax` runs the real model
(tiny-opt on CPU, or dummy weights on a GPU).

    python -m experiments.throughput --config configs/throughput.yaml [--resume]
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Literal

from experiments import common
from experiments.common import REPO_ROOT, provenance, write_json
from experiments.serving import point_metrics, run_sweep
from experiments.throughput.plots import plot
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, config_to_dict
from jpaged.config.presets import get_preset
from jpaged.paper.sim.config import SimConfig
from jpaged.paper.systems import SYSTEMS, build_engine, check_system
from jpaged.paper.trace_runner import run_trace
from jpaged.paper.workloads import Dataset, WorkloadConfig, generate_trace

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ThroughputConfig:
    """One panel of Fig. 12: a model on its GPUs, a dataset, and a rate sweep per system."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="opt-13b"))  # served model
    dataset: Dataset = "sharegpt"  # request length distribution
    systems: list[str] = dataclasses.field(default_factory=lambda: list(SYSTEMS))  # systems to sweep
    rates: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # system -> request rates (req/s)
    duration_s: float = 600.0  # trace length per point, seconds (paper: 3600; 900 for OPT-175B)
    num_requests: int | None = None  # cap on requests per trace; null = all that arrive in duration_s
    seed: int = 0  # seeds every trace (the same trace for every system at a rate)
    executor: Literal["sim", "jax"] = "sim"  # sim: cost model on a virtual clock; jax: the real model
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)  # modeled GPUs (sim only)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)  # KV pool (same slots for all systems)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)  # batch limits
    latency_threshold_factor: float = 4.0  # sustained rate: normalized latency <= factor x the sweep's lowest
    output: str = "results/throughput.json"  # results JSON, relative to the repo root
    figure: str = "results/throughput.png"  # figure, relative to the repo root

    def __post_init__(self) -> None:
        if not self.systems:
            raise ValueError("systems must name at least one system")
        for system in self.systems:
            check_system(system)
            rates = self.rates.get(system)
            if not rates or any(not (isinstance(r, (int, float)) and 0 < r < math.inf) for r in rates):
                raise ValueError(f"rates.{system} must be a non-empty list of finite rates > 0 (req/s), got {rates}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if not self.latency_threshold_factor > 1:
            raise ValueError(f"latency_threshold_factor must be > 1, got {self.latency_threshold_factor}")


def engine_config(config: ThroughputConfig) -> EngineConfig:
    """The EngineConfig every system of the sweep is built from."""
    return EngineConfig(model=config.model, cache=config.cache, scheduler=config.scheduler, executor=config.executor)


def make_trace(config: ThroughputConfig, rate: float) -> list:
    """The seeded trace at `rate`, without requests the engine could never take (logged)."""
    workload = WorkloadConfig(dataset=config.dataset, request_rate=rate, duration_s=config.duration_s,
                              num_requests=config.num_requests, seed=config.seed)
    trace = generate_trace(workload, vocab_size=get_preset(config.model.name).vocab_size)
    sched = config.scheduler
    kept = [r for r in trace if r.prompt_len + r.output_len <= sched.max_model_len
            and r.prompt_len <= sched.max_num_batched_tokens]
    if len(kept) < len(trace):
        logger.info("dropped %d of %d requests longer than max_model_len=%d", len(trace) - len(kept),
                    len(trace), sched.max_model_len)
    return kept


def run_point(config: ThroughputConfig, system: str, rate: float) -> dict:
    """Serves the trace at `rate` with `system`; returns the sweep point."""
    engine = build_engine(system, engine_config(config), config.sim)
    result = run_trace(engine, make_trace(config, rate))
    return {"system": system, "request_rate": rate, **point_metrics(result)}


def sustained_rates(points: list[dict], systems: list[str], threshold: float) -> dict[str, dict]:
    """Per system: the rate where normalized latency crosses `threshold` (linear interpolation),
    and whether the sweep bracketed it ("censored": below the lowest or above the highest rate)."""
    out = {}
    for system in systems:
        pts = sorted((p["request_rate"], p["normalized_latency"]) for p in points if p["system"] == system)
        over = next((k for k, (_, lat) in enumerate(pts) if lat > threshold), None)
        if over is None:
            out[system] = {"rate": pts[-1][0], "censored": "above_sweep"}
        elif over == 0:
            out[system] = {"rate": pts[0][0], "censored": "below_sweep"}
        else:
            (r0, l0), (r1, l1) = pts[over - 1], pts[over]
            out[system] = {"rate": r0 + (threshold - l0) / (l1 - l0) * (r1 - r0), "censored": None}
    return out


def _settings(config: ThroughputConfig) -> dict:
    """The config minus what may change between resumed runs (which points, where to write)."""
    settings = config_to_dict(config)
    for key in ("systems", "rates", "output", "figure"):
        settings.pop(key)
    return settings


def run(config: ThroughputConfig, resume: bool = False) -> dict:
    """Runs the sweep (under `resume`, only the points the output JSON lacks), then writes the JSON
    and the figure; returns the JSON."""
    out_path = REPO_ROOT / config.output
    keys = [(s, float(r)) for s in config.systems for r in config.rates[s]]
    prov = provenance(config, seed=config.seed,
                      device=None if config.executor == "jax" else f"simulated {config.sim.tp}x {config.sim.gpu}")
    points = run_sweep(out_path, _settings(config), keys, lambda p: (p["system"], p["request_rate"]),
                       lambda k: run_point(config, *k), prov, "throughput sweep", resume=resume)
    threshold = config.latency_threshold_factor * min(p["normalized_latency"] for p in points)
    sustained = sustained_rates(points, config.systems, threshold)
    result = {"points": sorted(points, key=lambda p: (config.systems.index(p["system"]), p["request_rate"])),
              "sustained_rate": {s: v["rate"] for s, v in sustained.items()},
              "sustained_rate_censored": {s: v["censored"] for s, v in sustained.items()},
              "latency_threshold": threshold,
              "total_wall_s": sum(p["wall_s"] for p in points),
              "settings": _settings(config), "provenance": prov}
    write_json(out_path, result)
    plot(REPO_ROOT / config.figure, points, config, threshold)
    print(f"latency_threshold  {threshold:.4f} s/token")
    for system in config.systems:
        mark = f" ({sustained[system]['censored']})" if sustained[system]["censored"] else ""
        print(f"sustained_rate.{system:<18} {sustained[system]['rate']:.3f} req/s{mark}")
    print(f"total_wall_s       {result['total_wall_s']:.1f}")
    return result


def main() -> None:
    """The command line: `python -m experiments.throughput [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], ThroughputConfig, run, "configs/throughput.yaml")
