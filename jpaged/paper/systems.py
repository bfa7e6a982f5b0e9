"""The serving systems the paper compares, each built as one LLMEngine (paper §6.1).

A system is a scheduling policy plus a KV memory manager; everything else (engine, StepPlans,
executors, cost model) is shared, so comparisons isolate memory management:

| system            | scheduling       | KV memory                                      | attention kernel |
|-------------------|------------------|------------------------------------------------|------------------|
| vllm              | iteration-level  | paged blocks (BlockManager)                    | paged            |
| orca_oracle       | iteration-level  | contiguous, reserves prompt + true output      | contiguous       |
| orca_pow2         | iteration-level  | contiguous, output rounded up to a power of 2  | contiguous       |
| orca_max          | iteration-level  | contiguous, reserves max_model_len             | contiguous       |
| fastertransformer | request-level    | contiguous, reserves max_model_len             | contiguous       |

Under simulation the baselines' decode attention is timed without the paged kernel's overhead
(`CostModelConfig.paged_attention_overhead`), since they read contiguous KV. Host (CPU) work per
step: vLLM and the Orca variants (the paper's reimplementations in vLLM's Python engine) pay the
measured vLLM line (`jpaged/paper/sim/vidur_a100_fit.json`); FasterTransformer is a C++ runtime whose
decode loop launches its kernels asynchronously, ahead of the GPU, so by default it pays none
(`jpaged.paper.sim.config.SimConfig.fastertransformer_host_overhead`;
docs/notes/simulator.md).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal

from jpaged.config import EngineConfig
from jpaged.core.sched.scheduler import Scheduler
from jpaged.engine import LLMEngine, sized_config
from jpaged.paper.baselines.contiguous import ContiguousBlockManager
from jpaged.paper.baselines.request_level import request_level_scheduler
from jpaged.paper.sim.config import SimConfig

if TYPE_CHECKING:
    from jpaged.paper.sim.executor import SimExecutor

System = Literal["vllm", "orca_oracle", "orca_pow2", "orca_max", "fastertransformer"]
SYSTEMS: tuple[str, ...] = ("vllm", "orca_oracle", "orca_pow2", "orca_max", "fastertransformer")
LABELS = {"vllm": "vLLM", "orca_oracle": "Orca (Oracle)", "orca_pow2": "Orca (Pow2)",
          "orca_max": "Orca (Max)", "fastertransformer": "FasterTransformer"}
_ORCA_POLICY = {"orca_oracle": "oracle", "orca_pow2": "pow2", "orca_max": "max"}


def check_system(system: str) -> None:
    """ValueError naming the allowed systems unless `system` is one of them."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {', '.join(SYSTEMS)}; got {system!r}")


def make_scheduler(system: str, config: EngineConfig) -> Scheduler:
    """The scheduler (and, inside it, the KV memory manager) of `system`."""
    check_system(system)
    sched, cache = config.scheduler, config.cache
    if system == "vllm":
        return Scheduler(sched, cache)
    if cache.enable_prefix_caching:
        raise ValueError(f"cache.enable_prefix_caching: {system} has no prefix cache; set it false")
    if system == "fastertransformer":
        return request_level_scheduler(sched, cache)
    manager = ContiguousBlockManager(cache.sized_num_blocks, cache.block_size, sched.max_model_len,
                                     _ORCA_POLICY[system], max_seqs=sched.max_num_seqs)
    return Scheduler(sched, cache, manager)


def make_sim_executor(system: str, config: EngineConfig, sim: SimConfig) -> SimExecutor:
    """A SimExecutor for `system` on the modeled hardware (contiguous kernels for the baselines)."""
    from jpaged.config.presets import get_preset
    from jpaged.paper.sim.executor import SimExecutor, load_beam_replay

    check_system(system)
    cost = sim.cost if system == "vllm" else dataclasses.replace(sim.cost, paged_attention_overhead=1.0)
    if system == "fastertransformer" and sim.fastertransformer_host_overhead == "none":
        cost = dataclasses.replace(cost, host_overhead_s=0.0, host_overhead_per_seq_s=0.0)
    candidates = None if sim.beam_trace is None else load_beam_replay(str(sim.beam_trace))
    return SimExecutor(get_preset(config.model.name), cost, gpu=sim.gpu, tp=sim.tp, dtype=sim.dtype,
                       block_size=config.cache.block_size, candidates=candidates)


def build_engine(system: str, config: EngineConfig, sim: SimConfig | None = None) -> LLMEngine:
    """An LLMEngine serving `system`; `config.executor` picks the simulator (with `sim`) or the real model."""
    if config.executor == "sim":
        executor = make_sim_executor(system, config, sim or SimConfig())
    else:
        from jpaged.executors.jax import JaxExecutor

        executor = JaxExecutor(config)
        config = sized_config(config, executor)  # a pool sized from memory: its block count
    return LLMEngine(config, executor=executor, scheduler=make_scheduler(system, config))
