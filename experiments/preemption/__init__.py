"""Recompute vs swap: the cost of recovering a preempted sequence, and end-to-end latency (paper Fig. 19).

(a) For one sequence of `seq_len` tokens at each block size: the time to swap its blocks out
(device -> host), back in (host -> device), and to recompute them (one prefill of its tokens).
Measured for real with the JAX executor on this machine's default device (on a CPU host the
"device" pool is host memory too, so copies are memcpys, not PCIe transfers), timing the
executor's own block operations and prefill step; the minimum of `repeats` timed calls after
a warm-up that compiles. Beside it, the cost model's numbers for the modeled GPU (A100, PCIe 4.0:
one copy per block per layer for K and for V, hence slow small blocks).
(b) vLLM's normalized latency with swap and with recompute preemption vs block size at a fixed
rate, simulated, with a KV pool small enough that requests get preempted.

    python -m experiments.preemption --config configs/preemption.yaml [--resume]
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

import matplotlib.pyplot as plt
import numpy as np
from tqdm.auto import tqdm

from experiments import common, plots
from experiments.common import REPO_ROOT, point_provenance, provenance, write_json
from experiments.serving import point_metrics, run_sweep
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, config_to_dict
from jpaged.config.presets import get_preset
from jpaged.core.sequence import SamplingParams
from jpaged.core.step_plan import StepPlan
from jpaged.engine import LLMEngine
from jpaged.paper.sim.config import SimConfig
from jpaged.paper.sim.cost_model import CostModel
from jpaged.paper.sim.gpus import get_gpu
from jpaged.paper.systems import build_engine
from jpaged.paper.trace_runner import run_trace
from jpaged.paper.workloads import Dataset, WorkloadConfig, generate_trace

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PreemptionConfig:
    """(a) the microbenchmark's model and sequence; (b) the simulated serving setup."""

    block_sizes: list[int] = dataclasses.field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])
    real_model: ModelConfig = dataclasses.field(  # (a) the model the real executor runs (dummy weights)
        default_factory=lambda: ModelConfig(name="opt-125m", dtype="float32", attention_backend="xla"))
    seq_len: int = 512  # (a) tokens of the preempted sequence
    repeats: int = 5  # (a) timed calls per measurement; the minimum is reported
    # (a) keep the real-executor rows of the output JSON (with the provenance of the run that measured
    # them) instead of measuring again: rerun only the simulated half
    keep_real: bool = False
    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="opt-13b"))  # (b), and (a)'s model
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)  # modeled GPU of (a)'s cost model and of (b)
    dataset: Dataset = "sharegpt"  # (b) request lengths
    request_rate: float = 2.0  # (b) the fixed Poisson rate (req/s)
    kv_slots: int = 4096  # (b) device KV slots at every block size: small, so that requests get preempted
    duration_s: float = 300.0  # (b) trace length, seconds
    seed: int = 0  # (b) seeds the trace
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)  # (b) batch limits
    output: str = "results/preemption.json"  # results JSON, relative to the repo root
    figure: str = "results/preemption.png"  # Fig. 19 (a) and (b)

    def __post_init__(self) -> None:
        if not self.block_sizes or any(b < 1 or b & (b - 1) for b in self.block_sizes):
            raise ValueError(f"block_sizes must be powers of two >= 1, got {self.block_sizes}")
        if not 1 <= self.seq_len <= self.scheduler.max_num_batched_tokens:
            raise ValueError(f"seq_len must be in [1, scheduler.max_num_batched_tokens="
                             f"{self.scheduler.max_num_batched_tokens}], got {self.seq_len}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.kv_slots < max(self.block_sizes) or not 0 < self.request_rate < float("inf"):
            raise ValueError(f"kv_slots must be >= the largest block size and request_rate finite and > 0; "
                             f"got {self.kv_slots}, {self.request_rate}")


def _min_time(fn, repeats: int) -> float:
    """Seconds: fn() once to warm up (compile), then the minimum of `repeats` timed calls."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_real(config: PreemptionConfig, block_size: int) -> dict:
    """Measured seconds to swap out, swap in and recompute one `seq_len`-token sequence's blocks."""
    n = -(-config.seq_len // block_size)  # blocks of the sequence
    engine_config = EngineConfig(
        model=config.real_model, executor="jax",
        # Room for the sequence plus the token its prefill samples; block 0 is reserved.
        cache=CacheConfig(block_size=block_size, num_blocks=-(-(config.seq_len + 1) // block_size) + 1,
                          num_host_blocks=n, watermark=0.0),
        scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=config.seq_len,
                                  max_model_len=config.seq_len + 1, policy="paper"))
    engine = LLMEngine(engine_config)
    executor = engine.executor
    out_pairs = [(1 + i, i) for i in range(n)]  # device block -> host block
    in_pairs = [(i, 1 + i) for i in range(n)]
    swap_out = _min_time(lambda: executor.execute(StepPlan.block_ops_only(swap_out=out_pairs)), config.repeats)
    swap_in = _min_time(lambda: executor.execute(StepPlan.block_ops_only(swap_in=in_pairs)), config.repeats)
    prompt = np.random.default_rng(0).integers(4, executor.vocab_size, config.seq_len).tolist()
    # A recompute is one prefill of all the sequence's tokens (its prompt plus what it generated):
    # one engine step that admits the sequence, prefills it and samples one token.
    recompute = _min_time(lambda: engine.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False),
                          config.repeats)
    kv_bytes = n * block_size * executor.spec.kv_bytes_per_token(executor.dtype)  # K and V, all layers
    return {"block_size": block_size, "num_blocks": n, "swap_out_s": swap_out, "swap_in_s": swap_in,
            "recompute_s": recompute, "kv_bytes": kv_bytes}


def modeled(config: PreemptionConfig, block_size: int) -> dict:
    """The cost model's seconds for the same operations on `config.model` and `config.sim`'s GPU."""
    cost = CostModel(get_preset(config.model.name), get_gpu(config.sim.gpu), config.sim.cost, tp=config.sim.tp,
                     dtype=config.sim.dtype, block_size=block_size)
    n = -(-config.seq_len // block_size)
    lens = np.array([config.seq_len])
    return {"block_size": block_size, "num_blocks": n, "swap_out_s": cost.swap_time(n), "swap_in_s": cost.swap_time(n),
            "recompute_s": cost.prefill_time(lens, lens)}


def run_serving_point(config: PreemptionConfig, mode: str, block_size: int) -> dict:
    """(b): vLLM with `mode` preemption at `block_size`, the same slots at every size."""
    num = config.kv_slots // block_size
    cache = CacheConfig(block_size=block_size, num_blocks=num + 1, num_host_blocks=num)
    sched = dataclasses.replace(config.scheduler, preemption_mode=mode)
    engine = build_engine("vllm", EngineConfig(model=config.model, cache=cache, scheduler=sched, executor="sim"),
                          config.sim)
    trace = generate_trace(WorkloadConfig(dataset=config.dataset, request_rate=config.request_rate,
                                          duration_s=config.duration_s, seed=config.seed),
                           vocab_size=get_preset(config.model.name).vocab_size)
    result = run_trace(engine, trace)
    return {"mode": mode, "block_size": block_size, "request_rate": config.request_rate, **point_metrics(result)}


def plot(path, real: list[dict], model: list[dict], points: list[dict], config: PreemptionConfig) -> None:
    """Fig. 19: (a) the three costs vs block size, measured and modeled; (b) latency per mode."""
    fig, axes = plt.subplots(1, 3, figsize=(12.5, 3.3))
    for ax, rows, title in ((axes[0], real, f"measured: {config.real_model.name}, this machine"),
                            (axes[1], model, f"cost model: {config.model.name}, {config.sim.gpu}")):
        sizes = [r["block_size"] for r in rows]
        for key, label in (("swap_in_s", "Swap in"), ("swap_out_s", "Swap out"), ("recompute_s", "Recompute")):
            ax.plot(sizes, [1e3 * r[key] for r in rows], marker="o", ms=3, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("Block size (tokens)")
        ax.set_ylabel(f"Time for {config.seq_len} tokens (ms)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    for mode, color in (("recompute", "tab:blue"), ("swap", "tab:orange")):
        pts = [p for p in points if p["mode"] == mode]
        x = np.arange(len(pts)) + (0.2 if mode == "swap" else -0.2)
        axes[2].bar(x, [p["normalized_latency"] for p in pts], width=0.4, color=color, label=mode.capitalize())
        axes[2].set_xticks(np.arange(len(pts)), [str(p["block_size"]) for p in pts])
    axes[2].set_xlabel("Block size (tokens)")
    axes[2].set_ylabel("Normalized latency (s/token)")
    axes[2].set_title(f"{config.dataset} at {config.request_rate} req/s, {config.kv_slots} KV slots", fontsize=9)
    axes[2].legend(fontsize=7)
    plots.save(fig, path)


def kept_real(config: PreemptionConfig) -> tuple[list[dict], dict]:
    """(a)'s rows and the provenance of the run that measured them, from the output JSON."""
    path = REPO_ROOT / config.output
    if not path.exists():
        raise FileNotFoundError(f"keep_real: {path} does not exist; run with keep_real: false first")
    previous = json.loads(path.read_text())
    rows = [r for r in previous["real"] if r["block_size"] in config.block_sizes]
    if sorted(r["block_size"] for r in rows) != sorted(config.block_sizes):
        raise ValueError(f"keep_real: {path} measured block sizes {[r['block_size'] for r in previous['real']]}, "
                         f"not all of {config.block_sizes}")
    prov = previous.get("real_provenance") or previous["provenance"]
    return sorted(rows, key=lambda r: config.block_sizes.index(r["block_size"])), prov


def run(config: PreemptionConfig, resume: bool = False) -> dict:
    """Measures (a), runs the (b) sweep (under `resume`, only the points the output JSON lacks);
    writes the JSON and the figure; returns the JSON."""
    prov = provenance(config, seed=config.seed)
    real, real_prov = kept_real(config) if config.keep_real else (
        [measure_real(config, b) for b in tqdm(config.block_sizes, desc="swap / recompute (real)")], prov)
    model = [modeled(config, b) for b in config.block_sizes]
    settings = config_to_dict(config)
    for key in ("block_sizes", "real_model", "seq_len", "repeats", "keep_real", "output", "figure"):
        settings.pop(key)
    keys = [(m, b) for b in config.block_sizes for m in ("recompute", "swap")]
    points = run_sweep(REPO_ROOT / config.output, settings, keys, lambda p: (p["mode"], p["block_size"]),
                       lambda k: run_serving_point(config, *k), prov, "swap vs recompute (simulated)", resume=resume)
    result = {"real": real, "real_device": real_prov.get("device"), "real_provenance": point_provenance(real_prov),
              "modeled": model,
              "modeled_gpu": config.sim.gpu, "points": points, "settings": settings, "provenance": prov}
    write_json(REPO_ROOT / config.output, result)
    plot(REPO_ROOT / config.figure, real, model, points, config)
    print(f"{'block_size':>10} {'real.swap_out_ms':>16} {'real.swap_in_ms':>15} {'real.recompute_ms':>17} "
          f"{'modeled.swap_out_ms':>19} {'modeled.recompute_ms':>20} {'recompute.norm_lat':>18} {'swap.norm_lat':>13}")
    for r, m in zip(real, model):
        lat = {p["mode"]: p["normalized_latency"] for p in points if p["block_size"] == r["block_size"]}
        print(f"{r['block_size']:>10} {1e3 * r['swap_out_s']:>16.2f} {1e3 * r['swap_in_s']:>15.2f} "
              f"{1e3 * r['recompute_s']:>17.2f} {1e3 * m['swap_out_s']:>19.2f} {1e3 * m['recompute_s']:>20.2f} "
              f"{lat['recompute']:>18.4f} {lat['swap']:>13.4f}")
    return result


def main() -> None:
    """The command line: `python -m experiments.preemption [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], PreemptionConfig, run, "configs/preemption.yaml")
