"""A fleet of simulated replicas behind a router: sustained rate and prefix-hit rate vs replicas.

Past one machine, by simulation (issue 33, item 5). For each deployment (a model on its GPUs; one
replica's tensor-parallel group may span servers, its all-reduces then priced over InfiniBand by
`jpaged.paper.sim.interconnect`), each workload (many shared prefixes; multi-turn conversations),
each routing policy (round-robin; sglang-router's cache-aware rule, `jpaged.paper.sim.routing`)
and each replica count R, a Poisson trace at R x the deployment's per-replica rates runs through
R real engines on one virtual clock (`jpaged.paper.sim.fleet`). A curve's sustained rate is where
its normalized latency crosses `latency_threshold_factor` x the lowest of its panel (deployment,
workload), as the throughput experiment defines it; the fleet's prefix-hit rate (prompt tokens
served from the replicas' prefix caches) is read at that rate. A plain run computes every point;
`--resume` keeps the points of the output JSON made with the same settings.

    python -m experiments.fleet --config configs/fleet.yaml [--resume]
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
from tqdm.auto import tqdm

from experiments import common
from experiments.common import REPO_ROOT, point_provenance, provenance, write_json
from experiments.fleet.plots import plot
from experiments.serving import reusable_points
from experiments.throughput import sustained_rates
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, config_to_dict
from jpaged.config.presets import get_preset
from jpaged.paper.metrics import summarize_requests
from jpaged.paper.sim.cost_model import CostModel
from jpaged.paper.sim.fleet import run_fleet
from jpaged.paper.sim.gpus import get_gpu
from jpaged.paper.sim.interconnect import InterHostLink, cross_host_cost
from jpaged.paper.sim.routing import POLICIES, RouterConfig, make_router
from jpaged.paper.systems import SimConfig, build_engine
from jpaged.paper.workloads import conversation_sessions, prefix_pool_sessions

WORKLOADS = ("shared_prefix", "multi_turn")


@dataclasses.dataclass(frozen=True)
class Deployment:
    """One replica's model and hardware, and the per-replica request rates swept for it."""

    name: str  # label in the results and the figure
    model: str  # jpaged.config.presets name
    num_blocks: int  # KV blocks of one replica's pool (Table 1's arithmetic over its GPUs), + reserved block 0
    rates_per_replica: dict[str, list[float]]  # workload -> request rates per replica (req/s); R replicas get R x
    gpu: str = "a100-40gb"  # jpaged.paper.sim.gpus name
    tp: int = 1  # tensor-parallel GPUs of one replica
    hosts: int = 1  # servers those GPUs span (> 1: all-reduces cross the inter-host link)

    def __post_init__(self) -> None:
        for field, check in (("model", get_preset), ("gpu", get_gpu)):
            try:
                check(getattr(self, field))
            except ValueError as exc:
                raise ValueError(f"deployments.{self.name}.{field}: {exc}") from exc
        if self.tp < 1 or self.hosts < 1 or self.tp % self.hosts:
            raise ValueError(f"deployments.{self.name}: tp must be >= 1 and hosts >= 1 dividing it, got tp {self.tp}, "
                             f"hosts {self.hosts}")
        if self.num_blocks < 2:
            raise ValueError(f"deployments.{self.name}.num_blocks must be >= 2, got {self.num_blocks}")


@dataclasses.dataclass(frozen=True)
class SharedPrefixWorkload:
    """One-turn requests, each a shared prefix (one of many, Zipf-popular) + a task input."""

    num_prefixes: int = 128  # distinct prefixes (system prompts, few-shot templates)
    prefix_len: int = 1000  # tokens of each prefix
    zipf_s: float = 1.0  # popularity of prefix j ~ (j + 1)^-zipf_s (an assumption; 0: uniform)
    input_median: float = 50.0  # task-input tokens after the prefix, LogNormal median
    input_sigma: float = 0.5  # its log-space spread
    output_median: float = 50.0  # output tokens, LogNormal median
    output_sigma: float = 0.5  # its log-space spread
    # Warm-up, not measured: max(warmup_s, warmup_requests / the per-replica rate) seconds, so every
    # replica has served about as many requests before the measurement whatever the rate (caches fill)
    warmup_s: float = 10.0
    warmup_requests: int = 80
    duration_s: float = 25.0  # seconds of measured arrivals after the warm-up

    def __post_init__(self) -> None:
        if not (self.warmup_s >= 0 and self.warmup_requests >= 0):
            raise ValueError(f"shared_prefix.warmup_s and warmup_requests must be >= 0, got {self.warmup_s}, "
                             f"{self.warmup_requests}")
        for name in ("num_prefixes", "prefix_len", "input_median", "input_sigma", "output_median", "output_sigma",
                     "duration_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"shared_prefix.{name} must be > 0, got {getattr(self, name)}")
        if not self.zipf_s >= 0:
            raise ValueError(f"shared_prefix.zipf_s must be >= 0, got {self.zipf_s}")


@dataclasses.dataclass(frozen=True)
class MultiTurnWorkload:
    """Conversations from the ShareGPT shapes; each turn's prompt is the whole history + the query."""

    mean_turns: float = 4.0  # Geometric turns per conversation, before the context limit ends it
    think_mean_s: float = 5.0  # Exponential seconds from a reply to the next query (an assumption)
    max_output_len: int = 1024  # reply cap (the paper's chatbot: 1024)
    # Warm-up, not measured: max(warmup_s, warmup_requests / the per-replica rate) seconds (the number
    # of open conversations settles within about one conversation's life)
    warmup_s: float = 30.0
    warmup_requests: int = 0
    duration_s: float = 45.0  # seconds of measured arrivals after the warm-up (later turns load, unmeasured)

    def __post_init__(self) -> None:
        if not (self.warmup_s >= 0 and self.warmup_requests >= 0):
            raise ValueError(f"multi_turn.warmup_s and warmup_requests must be >= 0, got {self.warmup_s}, "
                             f"{self.warmup_requests}")
        if not self.mean_turns >= 1:
            raise ValueError(f"multi_turn.mean_turns must be >= 1, got {self.mean_turns}")
        if not self.think_mean_s >= 0:
            raise ValueError(f"multi_turn.think_mean_s must be >= 0, got {self.think_mean_s}")
        if not (self.max_output_len >= 4 and self.duration_s > 0):
            raise ValueError(f"multi_turn.max_output_len must be >= 4 and duration_s > 0, got "
                             f"{self.max_output_len}, {self.duration_s}")


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    """Deployments x workloads x policies x replica counts, each a rate sweep."""

    deployments: list[Deployment]  # replica shapes, each with its rate grid
    replicas: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4, 8])  # R values
    policies: list[str] = dataclasses.field(default_factory=lambda: list(POLICIES))  # round_robin, cache_aware
    workloads: list[str] = dataclasses.field(default_factory=lambda: list(WORKLOADS))
    shared_prefix: SharedPrefixWorkload = dataclasses.field(default_factory=SharedPrefixWorkload)
    multi_turn: MultiTurnWorkload = dataclasses.field(default_factory=MultiTurnWorkload)
    router: RouterConfig = dataclasses.field(default_factory=RouterConfig)  # cache-aware knobs (sglang's defaults)
    link: InterHostLink = dataclasses.field(default_factory=InterHostLink)  # between servers (hosts > 1)
    seed: int = 0  # seeds every trace (the same sessions for every policy at a rate)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)  # per replica; num_blocks from the deployment
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)  # per replica
    latency_threshold_factor: float = 4.0  # sustained rate: normalized latency <= factor x the panel's lowest
    output: str = "results/fleet.json"  # results JSON, relative to the repo root
    figure: str = "results/fleet.png"  # sustained rate and hit rate vs R

    def __post_init__(self) -> None:
        if not self.deployments:
            raise ValueError("deployments must name at least one deployment")
        names = [d.name for d in self.deployments]
        if len(set(names)) < len(names):
            raise ValueError(f"deployments: names must be unique, got {names}")
        if not self.replicas or any(r < 1 for r in self.replicas):
            raise ValueError(f"replicas must be a non-empty list of ints >= 1, got {self.replicas}")
        for name, chosen, allowed in (("policies", self.policies, POLICIES), ("workloads", self.workloads, WORKLOADS)):
            if not chosen or set(chosen) - set(allowed):
                raise ValueError(f"{name} must be a non-empty list of {', '.join(allowed)}; got {chosen}")
        for d in self.deployments:
            for workload in self.workloads:
                rates = d.rates_per_replica.get(workload)
                if not rates or any(not (isinstance(r, (int, float)) and 0 < r < float("inf")) for r in rates):
                    raise ValueError(f"deployments.{d.name}.rates_per_replica.{workload} must be a non-empty list of "
                                     f"finite rates > 0 (req/s), got {rates}")
        if self.multi_turn.max_output_len + 4 >= self.scheduler.max_model_len:
            raise ValueError(f"multi_turn.max_output_len must be < scheduler.max_model_len - 4 "
                             f"({self.scheduler.max_model_len}), got {self.multi_turn.max_output_len}")
        if not self.latency_threshold_factor > 1:
            raise ValueError(f"latency_threshold_factor must be > 1, got {self.latency_threshold_factor}")


def deployment(config: FleetConfig, name: str) -> Deployment:
    """The deployment called `name`."""
    return next(d for d in config.deployments if d.name == name)


def sim_config(config: FleetConfig, d: Deployment) -> SimConfig:
    """One replica's modelled hardware: its GPUs, and its all-reduces across hosts when it spans them."""
    base = SimConfig(gpu=d.gpu, tp=d.tp)
    return dataclasses.replace(base, cost=cross_host_cost(base.cost, get_gpu(d.gpu), d.tp, d.hosts, config.link))


def engine_config(config: FleetConfig, d: Deployment) -> EngineConfig:
    """One replica's engine: the deployment's model and pool, prefix caching on."""
    cache = dataclasses.replace(config.cache, num_blocks=d.num_blocks, enable_prefix_caching=True)
    return EngineConfig(model=ModelConfig(name=d.model), cache=cache, scheduler=config.scheduler, executor="sim")


def warmup_s(config: FleetConfig, workload: str, per_replica: float) -> float:
    """Seconds of unmeasured arrivals before the measured ones, at `per_replica` req/s per replica."""
    w = getattr(config, workload)
    return max(w.warmup_s, w.warmup_requests / per_replica)


def make_sessions(config: FleetConfig, workload: str, rate: float, seconds: float, vocab_size: int) -> list:
    """The seeded sessions of `workload` offering `rate` requests/s for `seconds`."""
    if workload == "shared_prefix":
        w = config.shared_prefix
        return prefix_pool_sessions(rate, seconds, config.seed, num_prefixes=w.num_prefixes, prefix_len=w.prefix_len,
                                    zipf_s=w.zipf_s, input_median=w.input_median, input_sigma=w.input_sigma,
                                    output_median=w.output_median, output_sigma=w.output_sigma, vocab_size=vocab_size)
    m = config.multi_turn
    return conversation_sessions(rate, seconds, config.seed, mean_turns=m.mean_turns, think_mean_s=m.think_mean_s,
                                 max_model_len=config.scheduler.max_model_len, max_output_len=m.max_output_len,
                                 vocab_size=vocab_size)


def run_point(config: FleetConfig, name: str, workload: str, policy: str, replicas: int, per_replica: float) -> dict:
    """Serves one trace on `replicas` replicas of deployment `name` behind `policy`; the sweep point."""
    d = deployment(config, name)
    rate, warmup = replicas * per_replica, warmup_s(config, workload, per_replica)
    until = warmup + getattr(config, workload).duration_s
    sessions = make_sessions(config, workload, rate, until, get_preset(d.model).vocab_size)
    engines = [build_engine("vllm", engine_config(config, d), sim_config(config, d)) for _ in range(replicas)]
    router = make_router(policy, replicas, config.router)
    result = run_fleet(engines, router, sessions, measure_from=warmup, measure_until=until)
    summary = summarize_requests(result.records)
    return {"deployment": name, "workload": workload, "policy": policy, "replicas": replicas,
            "rate_per_replica": per_replica, "request_rate": rate,
            "normalized_latency": summary.pop("normalized_latency_s"), "prefix_hit_rate": result.prefix_hit_rate,
            "num_rejected": result.num_rejected, "decisions": result.decisions, "followups_routed": result.num_followups,
            "requests_per_replica": [r["requests"] for r in result.replicas],
            "busy_fraction": [r["busy_fraction"] for r in result.replicas],
            "num_preemptions": sum(r["num_preemptions"] for r in result.replicas),
            "router_tree_tokens": max(router.tree.sizes) if policy == "cache_aware" else 0,
            "warmup_s": warmup, "end_time_s": result.end_time_s, "wall_s": result.wall_s, **summary}


def summarize(points: list[dict], config: FleetConfig) -> tuple[dict, dict]:
    """Per (deployment, workload): the latency threshold; per (deployment, workload, policy, R): the
    sustained rate, whether the sweep bracketed it, the prefix-hit rate there (interpolated) and
    at the lowest rate swept (light load)."""
    thresholds, sustained = {}, {}
    for d in config.deployments:
        for workload in config.workloads:
            panel = [p for p in points if p["deployment"] == d.name and p["workload"] == workload]
            threshold = config.latency_threshold_factor * min(p["normalized_latency"] for p in panel)
            thresholds.setdefault(d.name, {})[workload] = threshold
            for policy in config.policies:
                for r in config.replicas:
                    curve = sorted((p for p in panel if p["policy"] == policy and p["replicas"] == r),
                                   key=lambda p: p["request_rate"])
                    found = sustained_rates([p | {"system": "curve"} for p in curve], ["curve"], threshold)["curve"]
                    hit = float(np.interp(found["rate"], [p["request_rate"] for p in curve],
                                          [p["prefix_hit_rate"] for p in curve]))
                    sustained.setdefault(d.name, {}).setdefault(workload, {}).setdefault(policy, {})[str(r)] = {
                        "rate": found["rate"], "censored": found["censored"], "prefix_hit_rate": hit,
                        "light_load_hit_rate": curve[0]["prefix_hit_rate"]}
    return thresholds, sustained


def step_costs(config: FleetConfig) -> dict:
    """Per deployment spanning hosts: a decode step (64 sequences of 1024 tokens) and a prefill step
    (one 1024-token prompt), in ms, priced as deployed and as if its GPUs shared one NVLink domain."""
    out = {}
    for d in config.deployments:
        if d.hosts == 1:
            continue
        spec, gpu = get_preset(d.model), get_gpu(d.gpu)
        models = {"cross_host": CostModel(spec, gpu, sim_config(config, d).cost, tp=d.tp),
                  "one_nvlink_domain": CostModel(spec, gpu, SimConfig().cost, tp=d.tp)}
        steps = {"decode_64x1024": (np.ones(64, np.int32), np.full(64, 1024, np.int32)),
                 "prefill_1024": (np.array([1024]), np.array([1024]))}
        out[d.name] = {step: {how: {part: 1e3 * t for part, t in m.breakdown(*shape).items()} for how, m in models.items()}
                       for step, shape in steps.items()}
    return out


def _settings(config: FleetConfig) -> dict:
    """The config minus what may change between resumed runs (which points, where to write)."""
    settings = config_to_dict(config)
    for key in ("replicas", "policies", "workloads", "output", "figure"):
        settings.pop(key)
    for d in settings["deployments"]:
        d.pop("rates_per_replica")
    return settings


def _key(point: dict) -> tuple:
    return point["deployment"], point["workload"], point["policy"], point["replicas"], point["rate_per_replica"]


def sweep(config: FleetConfig, prov: dict, resume: bool) -> list[dict]:
    """Every curve (deployment, workload, policy, R) at rising rates, stopping after its first point
    over factor x the lowest normalized latency its panel has shown so far: that threshold only
    falls as the panel fills, so the point stays over the final one and brackets the crossing. The
    partial JSON is rewritten after each point; under `resume`, points of the output JSON made with
    the same settings (and carrying their own provenance) are kept instead of computed."""
    out, settings = REPO_ROOT / config.output, _settings(config)
    curves = [(d, w, p, r) for d in config.deployments for w in config.workloads for r in config.replicas
              for p in config.policies]
    keys = {(d.name, w, p, r, float(x)) for d, w, p, r in curves for x in d.rates_per_replica[w]}
    kept = {_key(p): p for p in reusable_points(out, settings, keys, _key)} if resume else {}
    if resume:
        print(f"fleet sweep: reused {len(kept)} of {len(keys)} points from {out} (--resume)")
    stamp, points, lowest = point_provenance(prov), [], {}
    bar = tqdm(total=len(keys), desc="fleet sweep")
    for d, w, policy, r in curves:
        rates = sorted(float(x) for x in d.rates_per_replica[w])
        for i, x in enumerate(rates):
            bar.set_postfix_str(f"{d.name} {w} {policy} R{r} {x:g}/replica", refresh=True)
            point = kept.get((d.name, w, policy, r, x)) or run_point(config, d.name, w, policy, r, x) | {"provenance": stamp}
            points.append(point)
            write_json(out, {"points": points, "settings": settings, "provenance": prov})
            latency = point["normalized_latency"]
            lowest[d.name, w] = min(lowest.get((d.name, w), latency), latency)
            bar.update(1)
            if latency > config.latency_threshold_factor * lowest[d.name, w]:
                bar.update(len(rates) - i - 1)  # the rest of the curve lies past its crossing
                break
    bar.close()
    return points


def run(config: FleetConfig, resume: bool = False) -> dict:
    """Runs the sweep (under `resume`, only the points the output JSON lacks), then writes the JSON
    and the figure; returns the JSON."""
    prov = provenance(config, seed=config.seed, device="simulated fleet: " + "; ".join(
        f"{d.name}: {d.tp}x {d.gpu} on {d.hosts} host(s)" for d in config.deployments))
    out = REPO_ROOT / config.output
    wall, cpu = time.perf_counter(), time.process_time()
    points = sweep(config, prov, resume)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    thresholds, sustained = summarize(points, config)
    result = {"points": points, "sustained": sustained, "latency_threshold": thresholds,
              "step_costs_ms": step_costs(config), "total_wall_s": sum(p["wall_s"] for p in points),
              "run_wall_s": wall, "run_cpu_s": cpu, "settings": _settings(config), "provenance": prov}
    write_json(out, result)
    plot(REPO_ROOT / config.figure, result, config)
    for name, by_workload in sustained.items():
        for workload, by_policy in by_workload.items():
            for policy, by_r in by_policy.items():
                print(f"sustained.{name}.{workload}.{policy:<12} " + "  ".join(
                    f"R{r}: {v['rate']:.2f}{'+' if v['censored'] == 'above_sweep' else '-' if v['censored'] else ''}"
                    f" (hit {v['prefix_hit_rate']:.2f})" for r, v in by_r.items()))
    print(f"total_wall_s {result['total_wall_s']:.1f}  run_wall_s {wall:.1f}  run_cpu_s {cpu:.1f}")
    return result


def main() -> None:
    """The command line: `python -m experiments.fleet [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], FleetConfig, run, "configs/fleet.yaml")
