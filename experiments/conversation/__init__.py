"""Multi-round conversations with the history kept: what the prefix cache's host tier buys (issue 34).

The Fig. 17 workload as the systems after the paper serve it: each conversation's rounds arrive
one after another, the next after its previous reply and the user's think time, and its prompt is
the whole history (earlier queries and the replies the engine produced) plus the new query, never
cut (`jpaged.paper.workloads.conversation_sessions`; a conversation ends before the round that
would pass max_model_len). Conversations start as a Poisson process at the offered request rate.
One simulated replica serves them (`jpaged.paper.sim.fleet.run_fleet` with one engine: the same
event loop, the same measurement window) with its prefix cache on and a host tier of 0, 1x, 4x
... the device KV pool (`host_tiers`, in multiples of the pool's usable blocks). An evicted cached
block is copied to the tier beside the step; a round whose history reached the tier promotes it by
swap-ins before its step, each block priced by the cost model's PCIe figures (`swap_time`: the
GPU's practical host<->device bandwidth, ~25 GB/s per direction for PCIe 4.0 x16 on an A100,
`jpaged/paper/sim/gpus.py`, plus a per-layer copy latency).

Per (tier, policy, rate): the prefix-hit rate (prompt tokens served from either tier / prompt
tokens admitted, in the window), TTFT, normalized latency, the tier's traffic; per tier: the
sustained rate (normalized latency under `latency_threshold_factor` x the sweep's lowest).

    python -m experiments.conversation --config configs/conversation.yaml [--resume]

`experiments.conversation.cpu` is the real run on this CPU with the stdlib model.
"""

from __future__ import annotations

import dataclasses
import logging

import matplotlib.pyplot as plt

from experiments import common, plots
from experiments.common import REPO_ROOT, provenance, write_json
from experiments.serving import run_sweep
from experiments.throughput import sustained_rates
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, config_to_dict
from jpaged.config.presets import get_preset
from jpaged.core.kv.eviction import POLICIES
from jpaged.paper.metrics import summarize_requests
from jpaged.paper.sim.config import SimConfig
from jpaged.paper.sim.fleet import run_fleet
from jpaged.paper.sim.routing import make_router
from jpaged.paper.systems import build_engine
from jpaged.paper.workloads import conversation_sessions

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ConversationConfig:
    """The conversation workload, the host tiers and policies compared, and the rate sweep."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="opt-13b"))  # served model
    host_tiers: list[float] = dataclasses.field(default_factory=lambda: [0.0, 1.0, 4.0])  # x the device pool
    eviction_policies: list[str] = dataclasses.field(default_factory=lambda: ["lru"])  # both tiers' order
    rates: list[float] = dataclasses.field(default_factory=lambda: [1.0, 2.0, 3.0])  # offered rounds/s
    mean_turns: float = 4.0  # Geometric rounds per conversation before the context limit (an assumption)
    think_mean_s: float = 30.0  # Exponential seconds from a reply to the next query (an assumption)
    max_output_len: int = 1024  # reply cap (the paper's chatbot: 1024)
    warmup_s: float = 120.0  # arrivals before the window: not measured (open conversations settle)
    duration_s: float = 300.0  # seconds of measured arrivals after the warm-up
    seed: int = 0  # seeds the conversations (the same at every tier)
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)  # modeled GPU
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)  # device pool; the tier is set per point
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)  # batch limits
    latency_threshold_factor: float = 4.0  # sustained rate: normalized latency <= factor x the sweep's lowest
    output: str = "results/conversation.json"  # results JSON, relative to the repo root
    figure: str = "results/conversation.png"

    def __post_init__(self) -> None:
        if not self.host_tiers or any(not 0 <= x < float("inf") for x in self.host_tiers):
            raise ValueError(f"host_tiers must be a non-empty list of finite multiples >= 0, got {self.host_tiers}")
        if not self.eviction_policies or any(p not in POLICIES for p in self.eviction_policies):
            raise ValueError(f"eviction_policies must name some of {', '.join(POLICIES)}, got {self.eviction_policies}")
        if not self.rates or any(not 0 < r < float("inf") for r in self.rates):
            raise ValueError(f"rates must be a non-empty list of finite rates > 0 (req/s), got {self.rates}")
        if not (self.warmup_s >= 0 and self.duration_s > 0):
            raise ValueError(f"warmup_s must be >= 0 and duration_s > 0, got {self.warmup_s}, {self.duration_s}")


def label(tier: float, policy: str) -> str:
    """A curve's name: the tier's size and its policy."""
    return f"host {tier:g}x {policy}"


def host_blocks(config: ConversationConfig, tier: float) -> int:
    """The host tier's blocks at `tier` x the device pool's usable blocks (block 0 is reserved)."""
    return round(tier * (config.cache.num_blocks - 1))


def engine_config(config: ConversationConfig, tier: float, policy: str) -> EngineConfig:
    """The replica: prefix caching on, a host tier of `tier` x the device pool, `policy` in both tiers."""
    cache = dataclasses.replace(config.cache, enable_prefix_caching=True, num_host_cache_blocks=host_blocks(config, tier),
                                eviction_policy=policy)
    return EngineConfig(model=config.model, cache=cache, scheduler=config.scheduler, executor="sim")


def run_point(config: ConversationConfig, tier: float, policy: str, rate: float) -> dict:
    """Serves the conversations offering `rate` rounds/s with a host tier of `tier` x the pool."""
    until = config.warmup_s + config.duration_s
    sessions = conversation_sessions(rate, until, config.seed, mean_turns=config.mean_turns,
                                     think_mean_s=config.think_mean_s, max_model_len=config.scheduler.max_model_len,
                                     max_output_len=config.max_output_len,
                                     vocab_size=get_preset(config.model.name).vocab_size)
    engine = build_engine("vllm", engine_config(config, tier, policy), config.sim)
    result = run_fleet([engine], make_router("round_robin", 1), sessions, measure_from=config.warmup_s,
                       measure_until=until)
    summary = summarize_requests(result.records)
    (replica,) = result.replicas
    return {"host_tier": tier, "eviction_policy": policy, "system": label(tier, policy), "request_rate": rate,
            "host_cache_blocks": host_blocks(config, tier), "prefix_hit_rate": result.prefix_hit_rate,
            "normalized_latency": summary.pop("normalized_latency_s"), "num_rejected": result.num_rejected,
            "num_preemptions": replica["num_preemptions"], "busy_fraction": replica["busy_fraction"],
            "host_cache_promotions": replica["host_cache_promotions"],
            "host_cache_offloads": replica["host_cache_offloads"],
            "host_cache_evictions": replica["host_cache_evictions"],
            "prefix_cache_evictions": replica["prefix_cache_evictions"],
            "end_time_s": result.end_time_s, "wall_s": result.wall_s, **summary}


def _settings(config: ConversationConfig) -> dict:
    settings = config_to_dict(config)
    for key in ("host_tiers", "eviction_policies", "rates", "output", "figure"):
        settings.pop(key)
    return settings


def plot(config: ConversationConfig, points: list[dict], threshold: float) -> None:
    """Prefix-hit rate, mean TTFT and normalized latency against the offered rate, one curve per tier."""
    fig, axes = plt.subplots(1, 3, figsize=(12.6, 3.4))
    for name in dict.fromkeys(p["system"] for p in points):
        pts = sorted((p for p in points if p["system"] == name), key=lambda p: p["request_rate"])
        x = [p["request_rate"] for p in pts]
        axes[0].plot(x, [100 * p["prefix_hit_rate"] for p in pts], marker="o", ms=4, label=name)
        axes[1].plot(x, [p["mean_ttft_ms"] / 1e3 for p in pts], marker="o", ms=4, label=name)
        axes[2].plot(x, [p["normalized_latency"] for p in pts], marker="o", ms=4, label=name)
    axes[1].set_yscale("log")  # (seconds below the knee, minutes above it)
    axes[2].axhline(threshold, color="k", ls=":", lw=0.8, label="sustained threshold")
    axes[2].set_ylim(0, 2.5 * threshold)
    for ax, ylabel in zip(axes, ("Prefix-hit rate (%)", "Mean TTFT (s, log)", "Normalized latency (s/token)")):
        ax.set_xlabel("Request rate (rounds/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"Conversations, history kept: {config.model.name} on {config.sim.tp}x {config.sim.gpu} (simulated), "
                 f"host tier in multiples of the {config.cache.num_blocks - 1}-block device pool", fontsize=9)
    fig.tight_layout()
    plots.save(fig, REPO_ROOT / config.figure)


def run(config: ConversationConfig, resume: bool = False) -> dict:
    """Runs the sweep (under `resume`, only the points the output JSON lacks); writes the JSON and the
    figure; returns the JSON."""
    keys = [(float(t), p, float(r)) for t in config.host_tiers for p in config.eviction_policies for r in config.rates]
    prov = provenance(config, seed=config.seed, device=f"simulated {config.sim.tp}x {config.sim.gpu}")
    out = REPO_ROOT / config.output
    points = run_sweep(out, _settings(config), keys,
                       lambda p: (p["host_tier"], p["eviction_policy"], p["request_rate"]),
                       lambda k: run_point(config, *k), prov, "conversation sweep", resume=resume)
    threshold = config.latency_threshold_factor * min(p["normalized_latency"] for p in points)
    systems = list(dict.fromkeys(p["system"] for p in points))
    sustained = sustained_rates(points, systems, threshold)
    result = {"points": points,
              "sustained_rate": {s: v["rate"] for s, v in sustained.items()},
              "sustained_rate_censored": {s: v["censored"] for s, v in sustained.items()},
              "latency_threshold": threshold, "total_wall_s": sum(p["wall_s"] for p in points),
              "settings": _settings(config), "provenance": prov}
    write_json(out, result)
    plot(config, points, threshold)
    for p in points:
        print(f"{p['system']:<16} {p['request_rate']:5.2f} req/s  hit {100 * p['prefix_hit_rate']:5.1f}%  "
              f"ttft {p['mean_ttft_ms'] / 1e3:7.3f} s  norm_lat {p['normalized_latency']:.3f}  "
              f"promotions {p['host_cache_promotions']}")
    for system, v in sustained.items():
        print(f"sustained_rate.{system:<16} {v['rate']:.3f} req/s" + (f" ({v['censored']})" if v["censored"] else ""))
    return result


def main() -> None:
    """The command line: `python -m experiments.conversation [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], ConversationConfig, run, "configs/conversation.yaml")
