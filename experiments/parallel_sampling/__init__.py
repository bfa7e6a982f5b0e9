"""Parallel sampling and beam search: latency vs rate (paper Fig. 14), memory saving (Fig. 15).

Every request of a Poisson trace asks for `width` outputs: parallel sampling (n independent
samples sharing the prompt) or beam search (width beams sharing their common history). vLLM
shares blocks with copy-on-write; the Orca variants give every sequence its own contiguous
region and copy the parent's KV at each fork (`jpaged/paper/baselines/contiguous.py`). The simulator
has no model, so beam search runs under each of `beam_branching`'s models of where beams branch
(jpaged/paper/sim/executor.py): `synthetic` (seeded random log-probabilities of one flat shape) and
`recorded` (a trained model's beam search, recorded by experiments/record_beams into
`beam_trace` and replayed step by step). Each (mode, branching) pair is a series: parallel,
beam_synthetic, beam_recorded. Every vLLM point also measures the memory saving of sharing from
the block manager's refcounts: at each step, blocks in use (distinct blocks its sequences
reference) vs blocks without sharing (the sum of their table lengths), time-weighted over the
run; beam points also count how many distinct parents the width new beams of a step come from.

    python -m experiments.parallel_sampling --config configs/parallel_sampling.yaml [--resume]
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

from experiments import common
from experiments.common import REPO_ROOT, provenance, sha256_of, write_json
from experiments.parallel_sampling import plots
from experiments.serving import BranchingMeter, SharingMeter, point_metrics, run_sweep
from experiments.throughput import sustained_rates
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, config_to_dict
from jpaged.config.presets import get_preset
from jpaged.core.sequence import SamplingParams
from jpaged.paper.sim.config import SimConfig
from jpaged.paper.systems import LABELS, build_engine, check_system
from jpaged.paper.trace_runner import run_trace
from jpaged.paper.workloads import WorkloadConfig, generate_trace

logger = logging.getLogger(__name__)

Mode = Literal["parallel", "beam"]
BRANCHINGS = ("synthetic", "recorded")


@dataclasses.dataclass(frozen=True)
class ParallelSamplingConfig:
    """The sweeps of Fig. 14 and the memory-saving runs of Fig. 15."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="opt-13b"))  # served model
    sweep_datasets: list[str] = dataclasses.field(default_factory=lambda: ["alpaca"])  # Fig. 14 panels' traces
    saving_datasets: list[str] = dataclasses.field(default_factory=lambda: ["alpaca", "sharegpt"])  # Fig. 15
    modes: list[str] = dataclasses.field(default_factory=lambda: ["parallel", "beam"])  # parallel | beam
    widths: list[int] = dataclasses.field(default_factory=lambda: [2, 4, 6])  # n, or the beam width
    # beam search's branching models, each its own series: synthetic | recorded
    beam_branching: list[str] = dataclasses.field(default_factory=lambda: ["synthetic", "recorded"])
    beam_trace: str = "results/beam_traces.npz"  # the recorded beam searches (relative to the repo root)
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
        if "beam" in self.modes and (not self.beam_branching or any(b not in BRANCHINGS for b in self.beam_branching)):
            raise ValueError(f"beam_branching must list {' and/or '.join(BRANCHINGS)}, got {self.beam_branching}")
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


def series_of(config: ParallelSamplingConfig) -> list[tuple[str, str, str]]:
    """(series, mode, branching) in plot order: parallel, then beam search per branching model."""
    out = []
    for mode in config.modes:
        if mode == "parallel":
            out.append(("parallel", "parallel", "sampled"))
        else:
            out += [(f"beam_{b}", "beam", b) for b in config.beam_branching]
    return out


def sim_config(config: ParallelSamplingConfig, branching: str) -> SimConfig:
    """The modeled GPUs, replaying the recorded beam searches under `recorded` branching."""
    if branching != "recorded":
        return config.sim
    return dataclasses.replace(config.sim, beam_trace=str(REPO_ROOT / config.beam_trace))


def run_point(config: ParallelSamplingConfig, dataset: str, series: str, width: int, system: str,
              rate: float) -> dict:
    """Serves the trace at `rate`; vLLM points also carry the memory saving of sharing."""
    _, mode, branching = next(s for s in series_of(config) if s[0] == series)
    engine_config = EngineConfig(model=config.model, cache=config.cache, scheduler=config.scheduler, executor="sim")
    engine = build_engine(system, engine_config, sim_config(config, branching))
    trace = generate_trace(WorkloadConfig(dataset=dataset, request_rate=rate, duration_s=config.duration_s,
                                          seed=config.seed), vocab_size=get_preset(config.model.name).vocab_size)
    meter = SharingMeter(engine) if system == "vllm" else None
    branches = BranchingMeter() if mode == "beam" else None
    if branches is not None:
        engine.observers.append(branches)
    result = run_trace(engine, trace, observer=meter,
                       params_of=lambda r: sampling_params(mode, width, r.output_len, config.seed))
    point = {"dataset": dataset, "series": series, "mode": mode, "branching": branching, "width": width,
             "system": system, "request_rate": rate, **point_metrics(result)}
    if meter is not None:
        point["memory_saving"] = 100.0 * meter.saving
    if branches is not None:
        point |= branches.summary()
    return point


def _key(p: dict) -> tuple:
    return p["dataset"], p["series"], p["width"], p["system"], p["request_rate"]


def _settings(config: ParallelSamplingConfig) -> dict:
    settings = config_to_dict(config)
    for key in ("sweep_datasets", "saving_datasets", "modes", "widths", "beam_branching", "systems", "rates",
                "saving_rate", "output", "figure", "saving_figure"):
        settings.pop(key)
    if "beam" in config.modes and "recorded" in config.beam_branching:  # a new recording: new points
        settings["beam_trace_sha256"] = sha256_of(REPO_ROOT / config.beam_trace)
    return settings


def run(config: ParallelSamplingConfig, resume: bool = False) -> dict:
    """Runs the sweep (under `resume`, only the points the output JSON lacks); writes the JSON and
    both figures; returns the JSON."""
    series = [name for name, _, _ in series_of(config)]
    mode_of = {name: mode for name, mode, _ in series_of(config)}
    keys = [(d, x, w, s, float(r)) for d in config.sweep_datasets for x in series for w in config.widths
            for s in config.systems for r in config.rates[f"{mode_of[x]}{w}"]]
    keys += [(d, x, w, "vllm", float(config.saving_rate[d])) for d in config.saving_datasets
             for x in series for w in config.widths]
    keys = list(dict.fromkeys(keys))  # a saving run may coincide with a sweep point
    prov = provenance(config, seed=config.seed, device=f"simulated {config.sim.tp}x {config.sim.gpu}")
    out = REPO_ROOT / config.output
    points = run_sweep(out, _settings(config), keys, _key, lambda k: run_point(config, *k), prov,
                       "parallel sampling / beam search", resume=resume)
    saving_points = {d: {x: {str(w): next(p for p in points if _key(p) == (d, x, w, "vllm", float(config.saving_rate[d])))
                             for w in config.widths} for x in series} for d in config.saving_datasets}
    saving = {d: {x: {w: p["memory_saving"] for w, p in by.items()} for x, by in xs.items()}
              for d, xs in saving_points.items()}
    branching = {d: {x: {w: {k: p[k] for k in BranchingMeter.KEYS} for w, p in by.items()}
                     for x, by in xs.items() if x != "parallel"} for d, xs in saving_points.items()}
    sustained, thresholds = {}, {}
    for d in config.sweep_datasets:
        for x in series:
            for w in config.widths:
                panel = [p for p in points if p["dataset"] == d and p["series"] == x and p["width"] == w]
                threshold = config.latency_threshold_factor * min(p["normalized_latency"] for p in panel)
                thresholds[f"{d}.{x}{w}"] = threshold
                sustained[f"{d}.{x}{w}"] = sustained_rates(panel, config.systems, threshold)
    result = {"points": points, "memory_saving": saving, "branching": branching,
              "sustained_rate": {k: {s: v["rate"] for s, v in by.items()} for k, by in sustained.items()},
              "sustained_rate_censored": {k: {s: v["censored"] for s, v in by.items()} for k, by in sustained.items()},
              "latency_threshold": thresholds, "total_wall_s": sum(p["wall_s"] for p in points),
              "settings": _settings(config), "provenance": prov}
    write_json(out, result)
    figure = REPO_ROOT / config.figure
    for k, d in enumerate(config.sweep_datasets):  # the first dataset's panels go to `figure`
        plots.latency(figure if k == 0 else figure.with_name(f"{figure.stem}_{d}.png"), points, config, series, d)
    if saving:
        plots.saving(REPO_ROOT / config.saving_figure, saving, config.widths)
    for d, xs in saving.items():
        for x, by_width in xs.items():
            print(f"memory_saving.{d}.{x:<15} " + "  ".join(f"{w}: {v:5.1f}%" for w, v in by_width.items()))
    for d, xs in branching.items():
        for x, by_width in xs.items():
            print(f"one_parent_steps.{d}.{x:<15} " + "  ".join(f"{w}: {v['one_parent_step_fraction']:.2f}"
                                                                for w, v in by_width.items()))
    for key, by in result["sustained_rate"].items():
        print(f"sustained_rate.{key:<22} " + "  ".join(f"{LABELS[s]}: {r:.2f}" for s, r in by.items()))
    print(f"total_wall_s {result['total_wall_s']:.1f}")
    return result


def main() -> None:
    """The command line: `python -m experiments.parallel_sampling [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], ParallelSamplingConfig, run, "configs/parallel_sampling.yaml")
