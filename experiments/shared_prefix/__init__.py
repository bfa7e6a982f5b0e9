"""Shared prefix: normalized latency vs request rate, vLLM with prefix sharing vs Orca (paper Fig. 16).

A translation-like workload (the paper: WMT16 En->De on LLaMA-13B): every prompt is the same
few-shot prefix, `prefix_len` tokens (80 for 1-shot, 341 for 5-shot), followed by a short task
input. vLLM shares the prefix through its prefix cache (a radix tree over blocks): under
`pin_prefix` the prefix is pre-stored before the trace as in the paper (§4.4, `LLMEngine.pin_prefix`:
pinned, never evicted, its last partial block shared copy-on-write), else the first request fills
the cache with its full blocks and every request recomputes the partial one. Prefill runs only on
the rest; Orca (Oracle) reserves and computes every prompt whole. Task lengths are an assumption
(WMT16 news sentences: about two dozen tokens, translations ~1.2x longer), kept in the config.
Runs with the simulator by default and with the real model under `executor: jax`.

    python -m experiments.shared_prefix --config configs/shared_prefix.yaml [--resume]
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Literal

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
from jpaged.engine import LLMEngine
from jpaged.paper.trace_runner import StepObserver, run_trace
from jpaged.paper.workloads import MIN_LEN, lengths_trace, poisson_arrivals

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SharedPrefixConfig:
    """The prefixes, the task-length model and a rate sweep per (prefix, system)."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="llama-13b"))  # served model
    prefix_lens: list[int] = dataclasses.field(default_factory=lambda: [80, 341])  # 1-shot, 5-shot (tokens)
    systems: list[str] = dataclasses.field(default_factory=lambda: ["vllm", "orca_oracle"])
    rates: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # "<system>_<prefix_len>" -> req/s
    input_median: float = 24.0  # median task-input tokens (LogNormal; an assumption for WMT16 sentences)
    input_sigma: float = 0.5  # log-space spread of task inputs
    output_ratio: float = 1.2  # median output / input tokens (German runs longer than English)
    output_sigma: float = 0.2  # log-space spread of that ratio
    duration_s: float = 300.0  # trace length per point, seconds
    num_requests: int | None = None  # cap on requests per trace (the real executor's runs)
    seed: int = 0  # seeds every trace and the prefix's tokens
    pin_prefix: bool = False  # vLLM pre-stores the prefix before the trace (paper §4.4) instead of caching it on use
    executor: Literal["sim", "jax"] = "sim"  # sim: cost model on a virtual clock; jax: the real model
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)  # modeled GPUs (sim only)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)  # KV pool; vLLM turns prefix caching on
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)  # batch limits
    latency_threshold_factor: float = 4.0  # sustained rate: normalized latency <= factor x the panel's lowest
    output: str = "results/shared_prefix.json"  # results JSON, relative to the repo root
    figure: str = "results/shared_prefix.png"  # Fig. 16: one panel per prefix

    def __post_init__(self) -> None:
        if not self.prefix_lens or min(self.prefix_lens) < 1:
            raise ValueError(f"prefix_lens must be a non-empty list of ints >= 1, got {self.prefix_lens}")
        for system in self.systems:
            check_system(system)
            for prefix_len in self.prefix_lens:
                rates = self.rates.get(f"{system}_{prefix_len}")
                if not rates or any(not 0 < r < float("inf") for r in rates):
                    raise ValueError(f"rates.{system}_{prefix_len} must be a non-empty list of finite rates > 0 "
                                     f"(req/s), got {rates}")
        for name in ("input_median", "input_sigma", "output_ratio", "output_sigma", "duration_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def _rngs(config: SharedPrefixConfig) -> list[np.random.Generator]:
    """The prefix's, the arrivals', the lengths' and the task tokens' generators."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(config.seed).spawn(4)]


def make_prefix(config: SharedPrefixConfig, prefix_len: int) -> np.ndarray:
    """The shared prefix's `prefix_len` token ids (the same for every rate)."""
    return _rngs(config)[0].integers(4, get_preset(config.model.name).vocab_size, prefix_len, dtype=np.int32)


def make_trace(config: SharedPrefixConfig, prefix_len: int, rate: float) -> list:
    """Prefix + task input prompts at Poisson times; the same prefix tokens for every request."""
    _, arrival_rng, length_rng, token_rng = _rngs(config)
    vocab = get_preset(config.model.name).vocab_size
    prefix = make_prefix(config, prefix_len)
    arrivals = poisson_arrivals(rate, arrival_rng, duration_s=config.duration_s, num_requests=config.num_requests)
    n = len(arrivals)
    inputs = np.exp(length_rng.normal(np.log(config.input_median), config.input_sigma, n))
    outputs = inputs * np.exp(length_rng.normal(np.log(config.output_ratio), config.output_sigma, n))
    inputs = np.maximum(np.rint(inputs), MIN_LEN).astype(np.int64)
    outputs = np.maximum(np.rint(outputs), MIN_LEN).astype(np.int64)
    return lengths_trace(arrivals, inputs, outputs, token_rng, vocab, prefix=prefix)


def run_point(config: SharedPrefixConfig, prefix_len: int, system: str, rate: float,
              observe: Callable[[LLMEngine], StepObserver] | None = None) -> dict:
    """Serves the trace at `rate`; vLLM runs with its prefix cache (the prefix pre-stored under
    `pin_prefix`: the trace starts after it is computed) and reports the hit rate of the trace's
    prompts. `observe(engine)`, if given, makes an observer of every executed step of the trace."""
    cache = dataclasses.replace(config.cache, enable_prefix_caching=system == "vllm")
    engine_config = EngineConfig(model=config.model, cache=cache, scheduler=config.scheduler,
                                 executor=config.executor)
    engine = build_engine(system, engine_config, config.sim)
    pinned = system == "vllm" and config.pin_prefix
    if pinned:
        engine.pin_prefix(make_prefix(config, prefix_len).tolist())
    before = engine.prefix_cache_stats()  # (the pinning's own prompt is no trace prompt)
    result = run_trace(engine, make_trace(config, prefix_len, rate),
                       observer=None if observe is None else observe(engine))
    point = {"prefix_len": prefix_len, "system": system, "request_rate": rate, **point_metrics(result)}
    if system == "vllm":
        after = engine.prefix_cache_stats()
        point["prefix_cache_hit_rate"] = ((after["prefix_cached_tokens"] - before["prefix_cached_tokens"])
                                          / max(after["prefix_queried_tokens"] - before["prefix_queried_tokens"], 1))
        point["prefix_pinned"] = pinned
    return point


def _settings(config: SharedPrefixConfig) -> dict:
    settings = config_to_dict(config)
    for key in ("prefix_lens", "systems", "rates", "output", "figure"):
        settings.pop(key)
    return settings


def run(config: SharedPrefixConfig, resume: bool = False) -> dict:
    """Runs the sweep (under `resume`, only the points the output JSON lacks); writes the JSON and the
    figure; returns the JSON."""
    keys = [(n, s, float(r)) for n in config.prefix_lens for s in config.systems for r in config.rates[f"{s}_{n}"]]
    device = None if config.executor == "jax" else f"simulated {config.sim.tp}x {config.sim.gpu}"
    prov = provenance(config, seed=config.seed, device=device)
    out = REPO_ROOT / config.output
    points = run_sweep(out, _settings(config), keys, lambda p: (p["prefix_len"], p["system"], p["request_rate"]),
                       lambda k: run_point(config, *k), prov, "shared prefix sweep", resume=resume)
    sustained, thresholds = {}, {}
    fig, axes = plt.subplots(1, len(config.prefix_lens), figsize=(4.2 * len(config.prefix_lens), 3.4), squeeze=False)
    for ax, n in zip(axes[0], config.prefix_lens):
        panel = [p for p in points if p["prefix_len"] == n]
        thresholds[str(n)] = config.latency_threshold_factor * min(p["normalized_latency"] for p in panel)
        sustained[str(n)] = sustained_rates(panel, config.systems, thresholds[str(n)])
        plots.system_curves(ax, panel, "normalized_latency", config.systems, "Normalized latency (s/token)",
                            ymax=2.5 * thresholds[str(n)])
        ax.axhline(thresholds[str(n)], color="k", ls=":", lw=0.8)
        ax.set_title(f"shared prefix of {n} tokens", fontsize=9)
    axes[0][0].legend(fontsize=7)
    where = f"{config.sim.tp}x {config.sim.gpu} (simulated)" if config.executor == "sim" else "real model (jax)"
    fig.suptitle(f"{config.model.name} on {where}", fontsize=9)
    fig.tight_layout()
    plots.save(fig, REPO_ROOT / config.figure)
    result = {"points": points,
              "sustained_rate": {n: {s: v["rate"] for s, v in by.items()} for n, by in sustained.items()},
              "sustained_rate_censored": {n: {s: v["censored"] for s, v in by.items()} for n, by in sustained.items()},
              "latency_threshold": thresholds, "total_wall_s": sum(p["wall_s"] for p in points),
              "settings": _settings(config), "provenance": prov}
    write_json(out, result)
    for n, by in sustained.items():
        print(f"sustained_rate.{n:<4} " + "  ".join(
            f"{s}: {v['rate']:.2f}" + (f" ({v['censored']})" if v["censored"] else "") for s, v in by.items()))
    return result


def main() -> None:
    """The command line: `python -m experiments.shared_prefix [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], SharedPrefixConfig, run, "configs/shared_prefix.yaml")
