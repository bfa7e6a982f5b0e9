"""Chatbot serving: normalized latency vs request rate for vLLM and the Orca variants (paper Fig. 17).

Each request is one round of a synthesized ShareGPT-shaped conversation
(`jpaged.paper.workloads.conversation_lengths`): its prompt is the conversation so far (earlier
queries and replies) plus the new query, cut to the last `max_prompt_len` (1024) tokens; its
output is the reply, at most `max_output_len` (1024) tokens. No KV cache is kept across rounds,
so rounds are independent requests; they arrive as a Poisson process at the request rate. Long
histories push most prompts to the 1024 cut, so every Orca policy's buddy region rounds up to
the 2048-token maximum whatever it predicts for the output (the paper's explanation of Fig. 17).

    python -m experiments.chatbot --config configs/chatbot.yaml [--resume]
"""

from __future__ import annotations

import dataclasses
import logging

import matplotlib.pyplot as plt
import numpy as np

from experiments import common, plots
from experiments.common import REPO_ROOT, provenance, write_json
from experiments.serving import point_metrics, run_sweep
from experiments.throughput import sustained_rates
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, config_to_dict
from jpaged.config.presets import get_preset
from jpaged.paper.sim.config import SimConfig
from jpaged.paper.systems import build_engine, check_system
from jpaged.paper.trace_runner import run_trace
from jpaged.paper.workloads import conversation_lengths, lengths_trace, poisson_arrivals

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ChatbotConfig:
    """The conversation workload and a rate sweep per system."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="opt-13b"))  # served model
    systems: list[str] = dataclasses.field(default_factory=lambda: ["vllm", "orca_oracle", "orca_pow2", "orca_max"])
    rates: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # system -> request rates (req/s)
    mean_rounds: float = 4.0  # mean rounds per synthesized conversation (Geometric; an assumption)
    max_prompt_len: int = 1024  # history + query cut to its last tokens (paper: 1024)
    max_output_len: int = 1024  # most tokens generated per round (paper: 1024)
    duration_s: float = 600.0  # trace length per point, seconds
    seed: int = 0  # seeds every trace (the same for every system at a rate)
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)  # modeled GPUs
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)  # KV pool (same slots for all systems)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)  # batch limits
    latency_threshold_factor: float = 4.0  # sustained rate: normalized latency <= factor x the sweep's lowest
    output: str = "results/chatbot.json"  # results JSON, relative to the repo root
    figure: str = "results/chatbot.png"  # Fig. 17

    def __post_init__(self) -> None:
        for system in self.systems:
            check_system(system)
            rates = self.rates.get(system)
            if not rates or any(not 0 < r < float("inf") for r in rates):
                raise ValueError(f"rates.{system} must be a non-empty list of finite rates > 0 (req/s), got {rates}")
        if self.max_prompt_len + self.max_output_len > self.scheduler.max_model_len:
            raise ValueError(f"max_prompt_len + max_output_len must be <= scheduler.max_model_len "
                             f"({self.scheduler.max_model_len}), got {self.max_prompt_len} + {self.max_output_len}")
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")


def make_trace(config: ChatbotConfig, rate: float) -> list:
    """The seeded conversation-round trace at `rate` (the same lengths at every rate)."""
    arrival_rng, length_rng, token_rng = (np.random.default_rng(s)
                                          for s in np.random.SeedSequence(config.seed).spawn(3))
    arrivals = poisson_arrivals(rate, arrival_rng, duration_s=config.duration_s)
    prompts, outputs = conversation_lengths(len(arrivals), length_rng, mean_rounds=config.mean_rounds,
                                            max_prompt_len=config.max_prompt_len,
                                            max_output_len=config.max_output_len)
    return lengths_trace(arrivals, prompts, outputs, token_rng, get_preset(config.model.name).vocab_size)


def run_point(config: ChatbotConfig, system: str, rate: float) -> dict:
    """Serves the trace at `rate` with `system`."""
    engine_config = EngineConfig(model=config.model, cache=config.cache, scheduler=config.scheduler, executor="sim")
    result = run_trace(build_engine(system, engine_config, config.sim), make_trace(config, rate))
    return {"system": system, "request_rate": rate, **point_metrics(result)}


def _settings(config: ChatbotConfig) -> dict:
    settings = config_to_dict(config)
    for key in ("systems", "rates", "output", "figure"):
        settings.pop(key)
    return settings


def run(config: ChatbotConfig, resume: bool = False) -> dict:
    """Runs the sweep (under `resume`, only the points the output JSON lacks); writes the JSON and the
    figure; returns the JSON."""
    keys = [(s, float(r)) for s in config.systems for r in config.rates[s]]
    prov = provenance(config, seed=config.seed, device=f"simulated {config.sim.tp}x {config.sim.gpu}")
    out = REPO_ROOT / config.output
    points = run_sweep(out, _settings(config), keys, lambda p: (p["system"], p["request_rate"]),
                       lambda k: run_point(config, *k), prov, "chatbot sweep", resume=resume)
    threshold = config.latency_threshold_factor * min(p["normalized_latency"] for p in points)
    sustained = sustained_rates(points, config.systems, threshold)
    lengths = make_trace(config, 1.0)
    result = {"points": points,
              "sustained_rate": {s: v["rate"] for s, v in sustained.items()},
              "sustained_rate_censored": {s: v["censored"] for s, v in sustained.items()},
              "latency_threshold": threshold,
              "mean_prompt_len": float(np.mean([r.prompt_len for r in lengths])),
              "mean_output_len": float(np.mean([r.output_len for r in lengths])),
              "frac_prompts_at_cut": float(np.mean([r.prompt_len == config.max_prompt_len for r in lengths])),
              "total_wall_s": sum(p["wall_s"] for p in points), "settings": _settings(config), "provenance": prov}
    write_json(out, result)
    fig, ax = plt.subplots(figsize=(4.6, 3.4))
    plots.system_curves(ax, points, "normalized_latency", config.systems, "Normalized latency (s/token)",
                        ymax=2.5 * threshold)
    ax.axhline(threshold, color="k", ls=":", lw=0.8, label="sustained threshold")
    ax.legend(fontsize=7)
    ax.set_title(f"Chatbot: {config.model.name}, {config.sim.tp}x {config.sim.gpu}, "
                 f"{config.duration_s:.0f} s traces", fontsize=9)
    plots.save(fig, REPO_ROOT / config.figure)
    print(f"mean_prompt_len {result['mean_prompt_len']:.1f}  mean_output_len {result['mean_output_len']:.1f}  "
          f"frac_prompts_at_cut {result['frac_prompts_at_cut']:.2f}")
    for system, v in sustained.items():
        print(f"sustained_rate.{system:<12} {v['rate']:.3f} req/s" + (f" ({v['censored']})" if v["censored"] else ""))
    return result


def main() -> None:
    """The command line: `python -m experiments.chatbot [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], ChatbotConfig, run, "configs/chatbot.yaml")
