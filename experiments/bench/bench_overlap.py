"""The overlapped engine loop (scheduler.async_scheduling) against the synchronous one: how much host time it hides.

Two measurements, each as interleaved rounds (sync, overlapped, then overlapped, sync, ...):

- simulated device: the simulator's executor with `timed=True` really waits each step's modeled
  time (roofline cost model of a model on a GPU), from its launch to its collection, as a device
  would. The synchronous loop's wall time is device time + host time (+ each wait's oversleep);
  the overlapped loop hides part of the host time behind the device's. Per run `exposed_s` = wall
  - device time; `hidden_s` = sync exposed - overlapped exposed; `hidden_fraction` = hidden_s /
  the sync loop's CPU time (the host's work: the simulated waits are sleeps).
- real CPU executor: the jax executor on this machine's CPU, where the "device" is the same cores
  as the host, so overlap can only help as far as XLA leaves a core idle; wall and CPU time.

Every request arrives at time 0 with a fixed prompt and output length (ignore_eos), streamed
(`output_kind: delta`) so every step reports every running request, as a server's loop does.

    python -m experiments.bench.bench_overlap --config configs/bench_overlap.yaml
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time

import numpy as np

from experiments.common import REPO_ROOT, main, provenance, write_json
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SimPoint:
    """A modeled device: the model whose steps are priced and the GPU they are priced on."""

    model: str = "opt-125m"
    gpu: str = "a100-40gb"


@dataclasses.dataclass(frozen=True)
class BenchOverlapConfig:
    """The offline batch and the engine limits."""

    num_requests: int = 64  # requests, all at time 0
    prompt_len: int = 64  # tokens per prompt
    output_len: int = 128  # tokens per output (ignore_eos)
    rounds: int = 5  # interleaved (sync, overlapped) pairs per measurement
    sim: list[SimPoint] = dataclasses.field(default_factory=lambda: [SimPoint("opt-125m"), SimPoint("opt-13b")])
    cpu_model: str | None = "tiny-opt"  # the real CPU executor's model (None: skip that measurement)
    cpu_num_requests: int = 16  # the CPU measurement's batch (the CPU model runs far slower than a GPU)
    cache: CacheConfig = dataclasses.field(default_factory=lambda: CacheConfig(
        block_size=16, num_blocks=1024, num_host_blocks=0))
    scheduler: SchedulerConfig = dataclasses.field(default_factory=lambda: SchedulerConfig(
        max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=2048))
    seed: int = 0
    output: str = "results/bench_overlap.json"  # where the JSON result goes (relative to the repo root)

    def __post_init__(self) -> None:
        for name in ("num_requests", "prompt_len", "output_len", "rounds", "cpu_num_requests"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {getattr(self, name)!r}")
        if self.prompt_len + self.output_len > self.scheduler.max_model_len:
            raise ValueError(f"prompt_len + output_len ({self.prompt_len + self.output_len}) must be <= "
                             f"scheduler.max_model_len ({self.scheduler.max_model_len})")


def _serve(engine: LLMEngine, prompts: list[list[int]], output_len: int) -> dict:
    """Serves the batch to the end; wall and CPU seconds of the loop, the load average around it."""
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, output_kind="delta")
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, arrival_time=0.0)
    load = os.getloadavg()[0]
    wall, cpu = time.perf_counter(), time.process_time()
    num_tokens = 0
    while engine.has_unfinished():
        num_tokens += sum(len(o.outputs[0].token_ids) for o in engine.step())
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert num_tokens == len(prompts) * output_len, (num_tokens, len(prompts) * output_len)
    return {"wall_s": wall, "cpu_s": cpu, "steps": engine.num_steps, "steps_ahead": engine.num_steps_ahead,
            "dropped_rows": engine.num_dropped_rows, "load_1m_before": load, "load_1m_after": os.getloadavg()[0]}


def _engine_config(config: BenchOverlapConfig, model: str, executor: str, overlapped: bool) -> EngineConfig:
    return EngineConfig(model=ModelConfig(name=model, attention_backend="xla"), cache=config.cache,
                        scheduler=dataclasses.replace(config.scheduler, async_scheduling=overlapped),
                        executor=executor)


def _rounds(config: BenchOverlapConfig, make_engine, prompts: list[list[int]], extra=lambda engine: {}) -> list[dict]:
    """`config.rounds` interleaved pairs, the order alternating: [{"sync": run, "overlapped": run}]
    (`extra(engine)`: more fields of a run, read after it)."""
    pairs = []
    for r in range(config.rounds):
        pair = {}
        for overlapped in ((False, True) if r % 2 == 0 else (True, False)):
            engine = make_engine(overlapped)
            pair["overlapped" if overlapped else "sync"] = {**_serve(engine, prompts, config.output_len),
                                                            **extra(engine)}
        pairs.append(pair)
        logger.info("round %d: sync %.3f s, overlapped %.3f s", r, pair["sync"]["wall_s"], pair["overlapped"]["wall_s"])
    return pairs


def _summary(pairs: list[dict]) -> dict:
    """Medians over the rounds, and the per-round ratios overlapped / sync."""
    med = {mode: {k: statistics.median(p[mode][k] for p in pairs) for k in ("wall_s", "cpu_s")}
           for mode in ("sync", "overlapped")}
    return {"median": med,
            "wall_ratio_overlapped_over_sync": [p["overlapped"]["wall_s"] / p["sync"]["wall_s"] for p in pairs],
            "cpu_ratio_overlapped_over_sync": [p["overlapped"]["cpu_s"] / p["sync"]["cpu_s"] for p in pairs]}


def run_sim(config: BenchOverlapConfig, point: SimPoint, prompts: list[list[int]]) -> dict:
    """The simulated-device measurement of one (model, GPU)."""
    from jpaged.paper.sim.executor import SimExecutor

    def make_engine(overlapped):
        executor = SimExecutor(get_preset(point.model), gpu=point.gpu, block_size=config.cache.block_size, timed=True)
        return LLMEngine(_engine_config(config, point.model, "sim", overlapped), executor=executor)

    pairs = _rounds(config, make_engine, prompts, lambda engine: {"device_s": engine.executor.busy_s})
    for p in pairs:
        for run in p.values():
            # What the loop spent beyond the device's time: the host's work where it is not hidden,
            # and each wait's oversleep (waking up late on a loaded machine; no loop can hide it).
            run["exposed_s"] = run["wall_s"] - run["device_s"]
        # The host's work is its CPU time (the simulated device's waits are sleeps, not CPU).
        p["hidden_s"] = p["sync"]["exposed_s"] - p["overlapped"]["exposed_s"]
        p["hidden_fraction"] = p["hidden_s"] / p["sync"]["cpu_s"]
    return {"model": point.model, "gpu": point.gpu, "rounds": pairs, **_summary(pairs),
            "hidden_fraction_median": statistics.median(p["hidden_fraction"] for p in pairs)}


def run_cpu(config: BenchOverlapConfig, prompts: list[list[int]]) -> dict:
    """The real CPU executor: one executor (compiled once, by a warm-up run) serves every round."""
    from jpaged.executors.jax import JaxExecutor

    executor = JaxExecutor(_engine_config(config, config.cpu_model, "jax", False))
    _serve(LLMEngine(_engine_config(config, config.cpu_model, "jax", True), executor=executor), prompts,
           config.output_len)  # warm-up: every shape both loops will use
    compiled = executor.num_compilations
    pairs = _rounds(config, lambda o: LLMEngine(_engine_config(config, config.cpu_model, "jax", o), executor=executor),
                    prompts)
    return {"model": config.cpu_model, "num_requests": len(prompts), "rounds": pairs, **_summary(pairs),
            "compilations_after_warmup": executor.num_compilations - compiled}


def run(config: BenchOverlapConfig) -> dict:
    """Both measurements; writes the JSON to `config.output`."""
    rng = np.random.default_rng(config.seed)
    # (ids under 256: every preset, the tiny ones included, has them)
    prompts = [rng.integers(1, 256, size=config.prompt_len).tolist() for _ in range(config.num_requests)]
    result = {"provenance": provenance(config, seed=config.seed),
              "sim": [run_sim(config, point, prompts) for point in config.sim]}
    if config.cpu_model is not None:
        result["cpu"] = run_cpu(config, prompts[: config.cpu_num_requests])
    for row in result["sim"]:
        print(f"sim {row['model']} on {row['gpu']}: sync {row['median']['sync']['wall_s']:.3f} s, "
              f"overlapped {row['median']['overlapped']['wall_s']:.3f} s, "
              f"hidden_fraction {row['hidden_fraction_median']:.2f}")
    if "cpu" in result:
        row = result["cpu"]
        print(f"cpu {row['model']}: wall_ratio_overlapped_over_sync "
              f"{', '.join(f'{x:.3f}' for x in row['wall_ratio_overlapped_over_sync'])}; "
              f"cpu_ratio_overlapped_over_sync {', '.join(f'{x:.3f}' for x in row['cpu_ratio_overlapped_over_sync'])}")
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    main(__doc__.splitlines()[0], BenchOverlapConfig, run, "configs/bench_overlap.yaml")
