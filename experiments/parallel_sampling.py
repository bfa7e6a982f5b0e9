"""Parallel sampling and beam search: latency vs rate (paper Fig. 14), memory saving (Fig. 15).

Every request of a Poisson trace asks for `width` outputs: parallel sampling (n independent
samples sharing the prompt) or beam search (width beams sharing their common history). vLLM
shares blocks with copy-on-write; the Orca variants give every sequence its own contiguous
region and copy the parent's KV at each fork (`jpaged/baselines/contiguous.py`). Under the
simulator beam candidates are seeded random log-probabilities, so beams branch and die as in a
real search. Every vLLM point also measures the memory saving of sharing from the block
manager's refcounts: at each step, blocks in use (distinct blocks its sequences reference) vs
blocks without sharing (the sum of their table lengths), time-weighted over the run.

    python -m experiments.parallel_sampling --config configs/parallel_sampling.yaml [--resume]
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

import matplotlib.pyplot as plt
import numpy as np

from experiments import plots
from experiments.common import REPO_ROOT, main, provenance, write_json
from experiments.serving import SharingMeter, point_metrics, run_sweep
from experiments.throughput import sustained_rates
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, config_to_dict
from jpaged.models.presets import get_preset
from jpaged.sequence import SamplingParams
from jpaged.systems import LABELS, SimConfig, build_engine, check_system
from jpaged.trace_runner import run_trace
from jpaged.workloads import WorkloadConfig, generate_trace

logger = logging.getLogger(__name__)

Mode = Literal["parallel", "beam"]


@dataclasses.dataclass(frozen=True)
class ParallelSamplingConfig:
    """The sweeps of Fig. 14 and the memory-saving runs of Fig. 15."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="opt-13b"))  # served model
    sweep_datasets: list[str] = dataclasses.field(default_factory=lambda: ["alpaca"])  # Fig. 14 panels' traces
    saving_datasets: list[str] = dataclasses.field(default_factory=lambda: ["alpaca", "sharegpt"])  # Fig. 15
    modes: list[str] = dataclasses.field(default_factory=lambda: ["parallel", "beam"])  # parallel | beam
    widths: list[int] = dataclasses.field(default_factory=lambda: [2, 4, 6])  # n, or the beam width
    systems: list[str] = dataclasses.field(default_factory=lambda: ["vllm", "orca_oracle", "orca_pow2", "orca_max"])
    rates: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # "<mode><width>" -> req/s grid
    saving_rate: dict[str, float] = dataclasses.field(default_factory=dict)  # dataset -> req/s of the Fig. 15 run
    duration_s: float = 300.0  # trace length per point, seconds (paper: 3600)
    seed: int = 0  # seeds every trace (the same trace for every system at a rate) and the beams' draws
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)  # modeled GPUs
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)  # KV pool (same slots for all systems)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)  # batch limits
    latency_threshold_factor: float = 4.0  # sustained rate: normalized latency <= factor x the panel's lowest
    output: str = "results/parallel_sampling.json"  # results JSON, relative to the repo root
    figure: str = "results/parallel_sampling.png"  # Fig. 14: one panel per mode and width
    saving_figure: str = "results/parallel_sampling_saving.png"  # Fig. 15: memory saving per width

    def __post_init__(self) -> None:
        for system in self.systems:
            check_system(system)
        if "vllm" not in self.systems:
            raise ValueError("systems must include vllm (the memory saving is measured on it)")
        for name in ("sweep_datasets", "saving_datasets"):
            for dataset in getattr(self, name):
                if dataset not in ("sharegpt", "alpaca"):
                    raise ValueError(f"{name}: each must be 'sharegpt' or 'alpaca', got {dataset!r}")
        for mode in self.modes:
            if mode not in ("parallel", "beam"):
                raise ValueError(f"modes: each must be 'parallel' or 'beam', got {mode!r}")
        if not self.widths or min(self.widths) < 2:
            raise ValueError(f"widths must be a non-empty list of ints >= 2, got {self.widths}")
        for key in (f"{m}{w}" for m in self.modes for w in self.widths):
            rates = self.rates.get(key)
            if self.sweep_datasets and (not rates or any(not 0 < r < float("inf") for r in rates)):
                raise ValueError(f"rates.{key} must be a non-empty list of finite rates > 0 (req/s), got {rates}")
        for dataset in self.saving_datasets:
            if not self.saving_rate.get(dataset, 0) > 0:
                raise ValueError(f"saving_rate.{dataset} must be a rate > 0 (req/s), got {self.saving_rate.get(dataset)}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")


def sampling_params(mode: str, width: int, output_len: int, seed: int) -> SamplingParams:
    """A request's sampling: `width` samples or beams of exactly `output_len` tokens (EOS ignored)."""
    if mode == "beam":
        return SamplingParams(n=width, use_beam_search=True, max_tokens=output_len, ignore_eos=True, seed=seed)
    return SamplingParams(n=width, temperature=1.0, max_tokens=output_len, ignore_eos=True, seed=seed)


def run_point(config: ParallelSamplingConfig, dataset: str, mode: str, width: int, system: str, rate: float) -> dict:
    """Serves the trace at `rate`; vLLM points also carry the memory saving of sharing."""
    engine_config = EngineConfig(model=config.model, cache=config.cache, scheduler=config.scheduler, executor="sim")
    engine = build_engine(system, engine_config, config.sim)
    trace = generate_trace(WorkloadConfig(dataset=dataset, request_rate=rate, duration_s=config.duration_s,
                                          seed=config.seed), vocab_size=get_preset(config.model.name).vocab_size)
    meter = SharingMeter(engine) if system == "vllm" else None
    result = run_trace(engine, trace, observer=meter,
                       params_of=lambda r: sampling_params(mode, width, r.output_len, config.seed))
    point = {"dataset": dataset, "mode": mode, "width": width, "system": system, "request_rate": rate,
             **point_metrics(result)}
    if meter is not None:
        point["memory_saving"] = 100.0 * meter.saving
    return point


def _key(p: dict) -> tuple:
    return p["dataset"], p["mode"], p["width"], p["system"], p["request_rate"]


def _settings(config: ParallelSamplingConfig) -> dict:
    settings = config_to_dict(config)
    for key in ("sweep_datasets", "saving_datasets", "modes", "widths", "systems", "rates", "saving_rate",
                "output", "figure", "saving_figure"):
        settings.pop(key)
    return settings


def plot_latency(path, points: list[dict], config: ParallelSamplingConfig, dataset: str) -> None:
    """Fig. 14: normalized latency vs request rate, one panel per (mode, width)."""
    fig, axes = plt.subplots(len(config.modes), len(config.widths), figsize=(3.2 * len(config.widths),
                                                                            2.8 * len(config.modes)), squeeze=False)
    for i, mode in enumerate(config.modes):
        for j, width in enumerate(config.widths):
            panel = [p for p in points if (p["dataset"], p["mode"], p["width"]) == (dataset, mode, width)]
            low = min(p["normalized_latency"] for p in panel)
            plots.system_curves(axes[i][j], panel, "normalized_latency", config.systems,
                                "Normalized latency (s/token)", ymax=8 * low * config.latency_threshold_factor / 4)
            axes[i][j].set_title(f"{'parallel n' if mode == 'parallel' else 'beam width'} = {width}", fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{config.model.name}, {config.sim.tp}x {config.sim.gpu}, {dataset}, "
                 f"{config.duration_s:.0f} s traces (simulated)", fontsize=9)
    fig.tight_layout()
    plots.save(fig, path)


def plot_saving(path, saving: dict, widths: list[int]) -> None:
    """Fig. 15: memory saving (%) per width, parallel sampling and beam search, per dataset."""
    fig, axes = plt.subplots(1, len(saving), figsize=(3.6 * len(saving), 3.0), squeeze=False)
    for ax, (dataset, modes) in zip(axes[0], saving.items()):
        for k, (mode, by_width) in enumerate(modes.items()):
            x = np.arange(len(widths)) + 0.4 * k
            values = [by_width[str(w)] for w in widths]
            ax.bar(x, values, width=0.4, label="Parallel sampling" if mode == "parallel" else "Beam search")
            for xi, v in zip(x, values):
                ax.text(xi, v + 0.5, f"{v:.1f}", ha="center", fontsize=7)
        ax.set_xticks(np.arange(len(widths)) + 0.2, [str(w) for w in widths])
        ax.set_xlabel("# output sequences (n or beam width)")
        ax.set_ylabel("Memory saving (%)")
        ax.set_title(dataset, fontsize=9)
        ax.legend(fontsize=7)
    plots.save(fig, path)


def run(config: ParallelSamplingConfig, resume: bool = False) -> dict:
    """Runs the sweep (under `resume`, only the points the output JSON lacks); writes the JSON and
    both figures; returns the JSON."""
    keys = [(d, m, w, s, float(r)) for d in config.sweep_datasets for m in config.modes for w in config.widths
            for s in config.systems for r in config.rates[f"{m}{w}"]]
    keys += [(d, m, w, "vllm", float(config.saving_rate[d])) for d in config.saving_datasets
             for m in config.modes for w in config.widths]
    keys = list(dict.fromkeys(keys))  # a saving run may coincide with a sweep point
    prov = provenance(config, seed=config.seed, device=f"simulated {config.sim.tp}x {config.sim.gpu}")
    out = REPO_ROOT / config.output
    points = run_sweep(out, _settings(config), keys, _key, lambda k: run_point(config, *k), prov,
                       "parallel sampling / beam search", resume=resume)
    saving = {d: {m: {str(w): next(p["memory_saving"] for p in points
                                   if _key(p) == (d, m, w, "vllm", float(config.saving_rate[d])))
                      for w in config.widths} for m in config.modes} for d in config.saving_datasets}
    sustained, thresholds = {}, {}
    for d in config.sweep_datasets:
        for m in config.modes:
            for w in config.widths:
                panel = [p for p in points if p["dataset"] == d and p["mode"] == m and p["width"] == w]
                threshold = config.latency_threshold_factor * min(p["normalized_latency"] for p in panel)
                thresholds[f"{d}.{m}{w}"] = threshold
                sustained[f"{d}.{m}{w}"] = sustained_rates(panel, config.systems, threshold)
    result = {"points": points, "memory_saving": saving,
              "sustained_rate": {k: {s: v["rate"] for s, v in by.items()} for k, by in sustained.items()},
              "sustained_rate_censored": {k: {s: v["censored"] for s, v in by.items()} for k, by in sustained.items()},
              "latency_threshold": thresholds, "total_wall_s": sum(p["wall_s"] for p in points),
              "settings": _settings(config), "provenance": prov}
    write_json(out, result)
    figure = REPO_ROOT / config.figure
    for k, d in enumerate(config.sweep_datasets):  # the first dataset's panels go to `figure`
        plot_latency(figure if k == 0 else figure.with_name(f"{figure.stem}_{d}.png"), points, config, d)
    if saving:
        plot_saving(REPO_ROOT / config.saving_figure, saving, config.widths)
    for d, modes in saving.items():
        for m, by_width in modes.items():
            print(f"memory_saving.{d}.{m:<9} " + "  ".join(f"{w}: {v:5.1f}%" for w, v in by_width.items()))
    for key, by in result["sustained_rate"].items():
        print(f"sustained_rate.{key:<16} " + "  ".join(f"{LABELS[s]}: {r:.2f}" for s, r in by.items()))
    print(f"total_wall_s {result['total_wall_s']:.1f}")
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], ParallelSamplingConfig, run, "configs/parallel_sampling.yaml")
