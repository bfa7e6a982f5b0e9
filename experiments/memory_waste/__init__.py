"""KV cache memory waste of vLLM and the Orca variants (paper Fig. 2).

Each system serves the same Poisson ShareGPT trace (paper §6.2 setup: OPT-13B on one
A100-40GB) for `duration_s` simulated seconds at a rate that keeps every system loaded; the KV
slot space is split at every step into token states | reserved | internal fragmentation |
external fragmentation | free (definitions: jpaged/paper/kv_usage.py) and averaged over time, in two
windows (jpaged/paper/metrics.py): the whole run, and the steady state, from the first step during which
the pool was full (a preemption, or a waiting request held back for lack of memory) to the end, so
the warm-up while the pool first fills is left out. A second figure shows the block pool over a
window of the run: which request owns which block.

    python -m experiments.memory_waste --config configs/memory_waste.yaml
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
from tqdm.auto import tqdm

from experiments import common
from experiments.common import REPO_ROOT, provenance, write_json
from experiments.memory_waste import plots
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.core.kv.block_manager import BlockManager
from jpaged.paper.sim.config import SimConfig
from jpaged.paper.systems import build_engine, check_system
from jpaged.paper.trace_runner import run_trace
from jpaged.paper.workloads import Dataset, WorkloadConfig, generate_trace

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MemoryWasteConfig:
    """The trace, the systems, and the window of the block-pool picture."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="opt-13b"))  # served model
    dataset: Dataset = "sharegpt"  # request length distribution
    systems: list[str] = dataclasses.field(
        default_factory=lambda: ["vllm", "orca_max", "orca_pow2", "orca_oracle"])  # bars, left to right
    request_rate: float = 3.0  # Poisson req/s; above every system's capacity, so each stays loaded
    duration_s: float = 600.0  # simulated seconds each system serves (and averages over)
    seed: int = 0  # seeds the trace (the same for every system)
    sim: SimConfig = dataclasses.field(default_factory=SimConfig)  # modeled GPUs
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)  # KV pool (same slots for all)
    scheduler: SchedulerConfig = dataclasses.field(default_factory=SchedulerConfig)  # batch limits
    picture_systems: list[str] = dataclasses.field(default_factory=lambda: ["vllm", "orca_max"])  # pool pictures
    picture_start_s: float = 300.0  # start of the pictured window, simulated seconds
    picture_window_s: float = 60.0  # length of the pictured window, seconds
    picture_interval_s: float = 0.25  # seconds between two columns of the picture
    output: str = "results/memory_waste.json"  # results JSON, relative to the repo root
    figure: str = "results/memory_waste.png"  # stacked bars (Fig. 2)
    pool_figure: str = "results/memory_waste_pool.png"  # block pool over time

    def __post_init__(self) -> None:
        for system in (*self.systems, *self.picture_systems):
            check_system(system)
        if "fastertransformer" in self.systems:
            raise ValueError("systems: Fig. 2 compares vllm and the orca variants (fastertransformer's "
                             "free memory is idle by policy, not fragmented)")
        if not self.request_rate > 0 or not self.duration_s > 0:
            raise ValueError(f"request_rate and duration_s must be > 0, got {self.request_rate}, {self.duration_s}")
        if self.picture_window_s <= 0 or self.picture_interval_s <= 0 or self.picture_start_s < 0:
            raise ValueError("picture_start_s must be >= 0; picture_window_s and picture_interval_s > 0")


class PoolRecorder:
    """Step observer: snapshots which request owns each block, on a fixed time grid."""

    def __init__(self, engine, config: MemoryWasteConfig):
        self.scheduler = engine.scheduler
        self.times = config.picture_start_s + config.picture_interval_s * np.arange(
            int(config.picture_window_s / config.picture_interval_s))
        num_blocks = self.scheduler.block_manager.num_usable_blocks
        self.owner = np.full((len(self.times), num_blocks), -1, dtype=np.int64)  # [T, N] request id, -1 free
        self.written = np.zeros((len(self.times), num_blocks), dtype=bool)  # [T, N] block holds tokens
        self._next = 0

    def __call__(self, start: float, plan) -> None:
        """Fills every grid column whose time falls before this step's start (the state held since)."""
        while self._next < len(self.times) and self.times[self._next] <= start:
            self._snapshot(self._next)
            self._next += 1

    def _snapshot(self, t: int) -> None:
        bm = self.scheduler.block_manager
        for group in self.scheduler.running:
            for seq in group.seqs:
                if not bm.rows.has_seq(seq.seq_id):
                    continue
                ids = bm.rows.table(seq.seq_id) - 1  # block id b is column b - 1
                self.owner[t, ids] = int(group.request_id)
                self.written[t, ids] = True
                if not isinstance(bm, BlockManager):  # contiguous: the whole reserved region
                    base, size = bm.region(seq.seq_id)
                    self.owner[t, base - 1: base - 1 + size] = int(group.request_id)


def run(config: MemoryWasteConfig) -> dict:
    """Serves the trace with every system; writes the JSON, the bar chart and the pool picture."""
    engine_config = EngineConfig(model=config.model, cache=config.cache, scheduler=config.scheduler, executor="sim")
    trace = generate_trace(WorkloadConfig(dataset=config.dataset, request_rate=config.request_rate,
                                          duration_s=config.duration_s, seed=config.seed),
                           vocab_size=get_preset(config.model.name).vocab_size)
    systems, steady, pictures, runs = {}, {}, {}, {}
    for system in tqdm(config.systems, desc="memory waste"):
        engine = build_engine(system, engine_config, config.sim)
        recorder = PoolRecorder(engine, config) if system in config.picture_systems else None
        result = run_trace(engine, trace, track_kv=True, observer=recorder, until=config.duration_s)
        systems[system] = _states(result.kv_usage)
        if result.kv_usage_steady is not None:
            steady[system] = _states(result.kv_usage_steady)
        runs[system] = {**result.batch_sizes, "completed": len(result.records),
                        "num_preemptions": result.num_preemptions, "wall_s": result.wall_s}
        if recorder is not None:
            pictures[system] = (recorder.owner, recorder.written, config.picture_interval_s)
    result = {"systems": systems, "steady_state": steady, "runs": runs,
              "provenance": provenance(config, seed=config.seed, device=f"simulated {config.sim.tp}x {config.sim.gpu}")}
    write_json(REPO_ROOT / config.output, result)
    where = f"{config.model.name}, {config.sim.tp}x {config.sim.gpu}, {config.dataset} at {config.request_rate} req/s"
    plots.stacked_breakdown(REPO_ROOT / config.figure, {"whole run": systems, "steady state": steady},
                            f"KV cache usage ({where}); hatched: steady state")
    if pictures:
        plots.pool_pictures(REPO_ROOT / config.pool_figure, pictures,
                            f"Block pool over time ({where}); color = owning request, pale = reserved, white = free")
    print(f"{'system':<12} {'window':<7} {'token_states':>12} {'reserved':>9} {'internal':>9} {'external':>9} "
          f"{'free':>6} {'warmup_s':>9}")
    for system in systems:
        for window, states in (("whole", systems[system]), ("steady", steady.get(system))):
            if states is not None:
                print(f"{system:<12} {window:<7} {states['token_states']:>12.1f} {states['reserved']:>9.1f} "
                      f"{states['internal']:>9.1f} {states['external']:>9.1f} {states['free']:>6.1f} "
                      f"{runs[system]['warmup_s'] or 0:>9.1f}")
    return result


def _states(usage: dict[str, float]) -> dict[str, float]:
    """A KVUsageAccumulator breakdown under Fig. 2's state names."""
    return {"token_states": usage["token_states_pct"], "reserved": usage["reserved_pct"],
            "internal": usage["internal_frag_pct"], "external": usage["external_frag_pct"], "free": usage["free_pct"]}


def main() -> None:
    """The command line: `python -m experiments.memory_waste [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], MemoryWasteConfig, run, "configs/memory_waste.yaml")
