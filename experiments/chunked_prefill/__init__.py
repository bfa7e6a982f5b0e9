"""Beyond the paper: what chunked prefill buys — the paper's scheduler and the modern one, same engine.

For each scheduling variant (a policy and a token budget) and request rate, a Poisson trace (the
same trace for every variant at a rate) runs through vLLM's engine on the simulated GPU; the point
records TTFT, TPOT and ITL (inter-token latency: the gaps between consecutive tokens of a request,
pooled, as vLLM's benchmark_serving reports them; p50 and p99), the paper's normalized latency and
the batch sizes. The sustained rate of a variant is where its normalized latency crosses
`latency_threshold_factor` times the lowest of the whole sweep. A small run of the real model on
this CPU serves one trace with each variant (wall clock), so the same code is measured for real.

    python -m experiments.chunked_prefill --config configs/chunked_prefill.yaml
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Literal

import matplotlib.pyplot as plt
import numpy as np

from experiments import common, plots
from experiments.common import REPO_ROOT, provenance, write_json
from experiments.serving import point_metrics, run_sweep
from experiments.throughput import sustained_rates
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, config_to_dict
from jpaged.config.presets import get_preset
from jpaged.engine import LLMEngine
from jpaged.paper.metrics import summarize_token_times
from jpaged.paper.sim.config import SimConfig
from jpaged.paper.systems import build_engine, make_scheduler
from jpaged.paper.trace_runner import run_trace
from jpaged.paper.workloads import Dataset, TraceRequest, WorkloadConfig, generate_trace

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to schedule: a policy and its token budget."""

    name: str  # label in the results and the figure
    policy: Literal["paper", "chunked"]  # SchedulerConfig.policy
    max_num_batched_tokens: int  # the step's token budget
    long_prefill_token_threshold: int = 0  # chunked: most prompt tokens per sequence per step (0 = no cap)


@dataclasses.dataclass(frozen=True)
class RealRun:
    """The small real-model run on this machine's CPU (wall clock)."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="tiny-opt",
                                                                               attention_backend="xla"))
    num_requests: int = 48  # requests in the trace
    request_rate: float = 40.0  # Poisson arrivals, req/s
    length_scale: float = 0.25  # ShareGPT-shaped lengths scaled to the tiny model's context
    max_model_len: int = 512  # the tiny model's positions
    num_blocks: int = 257  # KV pool (16-token blocks, block 0 reserved)

    def __post_init__(self) -> None:
        if self.num_requests < 1 or not 0 < self.length_scale <= 1 or not self.request_rate > 0:
            raise ValueError("real: num_requests >= 1, request_rate > 0 and length_scale in (0, 1] required, got "
                             f"{self.num_requests}, {self.request_rate}, {self.length_scale}")


@dataclasses.dataclass(frozen=True)
class ChunkedPrefillConfig:
    """Variants x request rates on one simulated GPU, plus the small real run."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="opt-13b"))  # served model
    dataset: Dataset = "sharegpt"  # request length distribution
    variants: list[Variant] = dataclasses.field(default_factory=list)  # scheduling variants to compare
    rates: list[float] = dataclasses.field(default_factory=list)  # request rates (req/s), every variant
    duration_s: float = 600.0  # trace length per point, seconds
    seed: int = 0  # seeds every trace (the same trace for every variant at a rate)
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)  # modeled GPUs
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)  # KV pool
    max_num_seqs: int = 256  # sequence budget of every variant
    max_model_len: int = 2048  # longest prompt + output
    preemption_mode: Literal["swap", "recompute"] = "recompute"  # recovery when blocks run out
    latency_threshold_factor: float = 4.0  # sustained rate: normalized latency <= factor x the sweep's lowest
    real: RealRun | None = dataclasses.field(default_factory=RealRun)  # null: skip the real run
    output: str = "results/chunked_prefill.json"  # results JSON, relative to the repo root
    figure: str = "results/chunked_prefill.png"  # figure, relative to the repo root

    def __post_init__(self) -> None:
        names = [v.name for v in self.variants]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"variants must name at least one variant, each once, got {names}")
        if not self.rates or any(not r > 0 for r in self.rates):
            raise ValueError(f"rates must be a non-empty list of rates > 0 (req/s), got {self.rates}")
        if not self.duration_s > 0 or not self.latency_threshold_factor > 1:
            raise ValueError(f"duration_s must be > 0 and latency_threshold_factor > 1, got "
                             f"{self.duration_s}, {self.latency_threshold_factor}")


def engine_config(config: ChunkedPrefillConfig, variant: Variant, *, model: ModelConfig | None = None,
                  cache: CacheConfig | None = None, max_model_len: int | None = None) -> EngineConfig:
    """The EngineConfig of `variant` (the simulated panel unless `model` etc. say otherwise)."""
    scheduler = SchedulerConfig(max_num_seqs=min(config.max_num_seqs, variant.max_num_batched_tokens),
                                max_num_batched_tokens=variant.max_num_batched_tokens,
                                max_model_len=max_model_len or config.max_model_len,
                                preemption_mode=config.preemption_mode, policy=variant.policy,
                                long_prefill_token_threshold=variant.long_prefill_token_threshold)
    return EngineConfig(model=model or config.model, cache=cache or config.cache, scheduler=scheduler,
                        executor="sim" if model is None else "jax")


def make_trace(config: ChunkedPrefillConfig, rate: float) -> list[TraceRequest]:
    """The seeded trace at `rate` that every variant serves (see `admissible`)."""
    workload = WorkloadConfig(dataset=config.dataset, request_rate=rate, duration_s=config.duration_s,
                              seed=config.seed)
    trace = generate_trace(workload, vocab_size=get_preset(config.model.name).vocab_size)
    return admissible(config, trace, config.max_model_len)


def admissible(config: ChunkedPrefillConfig, trace: list[TraceRequest], max_model_len: int) -> list[TraceRequest]:
    """The requests every variant can take: within max_model_len, and prompts within the token
    budget of every `paper` variant (it prefills whole prompts; chunked prefill would split them),
    so that all variants serve the same requests."""
    budgets = [v.max_num_batched_tokens for v in config.variants if v.policy == "paper"]
    longest = min(budgets + [max_model_len])
    return [r for r in trace if r.prompt_len + r.output_len <= max_model_len and r.prompt_len <= longest]


def run_point(config: ChunkedPrefillConfig, variant: Variant, rate: float) -> dict:
    """Serves the trace at `rate` with `variant` on the simulated GPU; returns the sweep point."""
    engine = build_engine("vllm", engine_config(config, variant), config.sim)
    result = run_trace(engine, make_trace(config, rate), track_token_times=True)
    return {"variant": variant.name, "request_rate": rate, **point_metrics(result),
            **summarize_token_times(result.token_times)}


def run_real(config: ChunkedPrefillConfig) -> list[dict]:
    """Each variant serves one scaled-down trace with the real model on this CPU (wall clock)."""
    real = config.real
    spec = get_preset(real.model.name)
    workload = WorkloadConfig(dataset=config.dataset, request_rate=real.request_rate, duration_s=None,
                              num_requests=real.num_requests, seed=config.seed)
    scaled = []
    for r in generate_trace(workload, vocab_size=spec.vocab_size):
        prompt_len = max(1, int(r.prompt_len * real.length_scale))
        scaled.append(dataclasses.replace(r, prompt_len=prompt_len, prompt_token_ids=r.prompt_token_ids[:prompt_len],
                                          output_len=max(1, int(r.output_len * real.length_scale))))
    trace = admissible(config, scaled, real.max_model_len)
    cache = CacheConfig(block_size=16, num_blocks=real.num_blocks, num_host_blocks=0)
    rows = []
    from jpaged.executors.jax import JaxExecutor

    for variant in config.variants:
        engine_cfg = engine_config(config, variant, model=real.model, cache=cache, max_model_len=real.max_model_len)
        executor = JaxExecutor(engine_cfg)
        # A first pass compiles the step shapes; the second, on a fresh scheduler, is timed.
        run_trace(LLMEngine(engine_cfg, executor, make_scheduler("vllm", engine_cfg)), trace)
        result = run_trace(LLMEngine(engine_cfg, executor, make_scheduler("vllm", engine_cfg)), trace,
                           track_token_times=True)
        rows.append({"variant": variant.name, "num_requests": len(trace), **point_metrics(result),
                     **summarize_token_times(result.token_times)})
    return rows


def _settings(config: ChunkedPrefillConfig) -> dict:
    settings = config_to_dict(config)
    for key in ("rates", "output", "figure", "real"):
        settings.pop(key)
    return settings


def plot(path, points: list[dict], config: ChunkedPrefillConfig, threshold: float):
    """Normalized latency, p99 TTFT, p99 ITL and median TPOT against request rate, per variant."""
    panels = (("normalized_latency", "Normalized latency (s/token)", 1.0), ("p99_ttft_ms", "p99 TTFT (s)", 1e-3),
              ("p99_itl_ms", "p99 ITL (ms)", 1.0), ("median_tpot_ms", "median TPOT (ms)", 1.0))
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.4))
    colors = plt.cm.viridis(np.linspace(0, 0.85, len(config.variants)))
    for ax, (key, label, scale) in zip(axes, panels):
        for variant, color in zip(config.variants, colors):
            pts = sorted((p["request_rate"], p[key] * scale) for p in points if p["variant"] == variant.name)
            ax.plot(*zip(*pts), marker="o", ms=3, color=color, label=variant.name)
        ax.set_xlabel("Request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    low = min(p["normalized_latency"] for p in points)
    axes[0].set_ylim(0, max(10 * low, 1.5 * threshold))
    axes[0].axhline(threshold, color="k", ls=":", lw=0.8)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{config.model.name} on {config.sim.tp}x {config.sim.gpu}, {config.dataset}, "
                 f"{config.duration_s:.0f} s traces: scheduling policies", fontsize=9)
    return plots.save(fig, path)


def run(config: ChunkedPrefillConfig, resume: bool = False) -> dict:
    """The sweep (under `resume`, only missing points), the real run, the JSON and the figure."""
    out_path = REPO_ROOT / config.output
    variants = {v.name: v for v in config.variants}
    keys = [(v, float(r)) for v in variants for r in config.rates]
    prov = provenance(config, seed=config.seed, device=f"simulated {config.sim.tp}x {config.sim.gpu}")
    points = run_sweep(out_path, _settings(config), keys, lambda p: (p["variant"], p["request_rate"]),
                       lambda k: run_point(config, variants[k[0]], k[1]), prov, "chunked prefill sweep",
                       resume=resume)
    threshold = config.latency_threshold_factor * min(p["normalized_latency"] for p in points)
    sustained = sustained_rates([p | {"system": p["variant"]} for p in points], list(variants), threshold)
    real = None
    if config.real is not None:
        real = {"rows": run_real(config), "provenance": provenance(config, seed=config.seed),
                "load_average": os.getloadavg()}
    result = {"points": points, "sustained_rate": {v: s["rate"] for v, s in sustained.items()},
              "sustained_rate_censored": {v: s["censored"] for v, s in sustained.items()},
              "latency_threshold": threshold, "real": real, "settings": _settings(config), "provenance": prov}
    write_json(out_path, result)
    plot(REPO_ROOT / config.figure, points, config, threshold)
    print(f"latency_threshold  {threshold:.4f} s/token")
    for name, s in sustained.items():
        mark = f" ({s['censored']})" if s["censored"] else ""
        print(f"sustained_rate.{name:<16} {s['rate']:.3f} req/s{mark}")
    for row in (real or {}).get("rows", []):
        print(f"real.{row['variant']:<16} p50/p99 ttft {row['median_ttft_ms']:.1f}/{row['p99_ttft_ms']:.1f} ms  "
              f"p50/p99 itl {row['median_itl_ms']:.1f}/{row['p99_itl_ms']:.1f} ms  wall_s {row['wall_s']:.1f}")
    return result


def main() -> None:
    """The command line: `python -m experiments.chunked_prefill [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], ChunkedPrefillConfig, run, "configs/chunked_prefill.yaml")
