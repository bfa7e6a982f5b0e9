"""Decode-step micro-benchmark: one jitted paged decode step of the real model, wall and CPU time.

For each model, `num_seqs` sequences of `context_len` tokens sit in a paged pool with scattered
block tables; the same decode step (one new token per sequence, the pool donated and returned)
runs `steps` times after `warmup_steps`, each waited for. The median wall time and the mean CPU
time (all threads of this process) per step are reported: the model step as the executor runs
it, including the host cost of handing the step arrays and the parameter tree to jit.

    python -m experiments.bench.bench_decode --config configs/bench_decode.yaml

Uses only the ModelRunner / load_params / StepPlan API (its plans come from
experiments.paged_batch), so it also runs against an older checkout that has them (PYTHONPATH) for
A/B comparisons.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from experiments.common import REPO_ROOT, main, provenance, write_json
from experiments.paged_batch import plan_from_contexts, scattered_tables
from jpaged.config import ModelConfig
from jpaged.models.checkpoint import load_params
from jpaged.models.kv_pool import init_kv_pool
from jpaged.models.runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BenchDecodeConfig:
    """Models and the shape of the decode step."""

    models: list[str] = dataclasses.field(default_factory=lambda: ["tiny-llama", "opt-125m"])  # presets, dummy weights
    dtype: str = "float32"  # model.dtype of every model
    attention_backend: str = "xla"  # model.attention_backend
    num_seqs: int = 32  # sequences in the decode batch
    context_len: int = 256  # tokens each sequence already holds (the new one included)
    block_size: int = 16
    warmup_steps: int = 5  # untimed steps after the compile
    steps: int = 50  # timed steps
    seed: int = 0
    output: str = "results/bench_decode.json"  # where the JSON result goes (relative to the repo root)

    def __post_init__(self) -> None:
        for name in ("num_seqs", "context_len", "block_size", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.models:
            raise ValueError("models must name at least one preset")


def bench_model(config: BenchDecodeConfig, name: str) -> dict:
    """Times the decode step of preset `name`; returns microseconds per step (wall median, CPU mean)."""
    model = ModelConfig(name=name, dtype=config.dtype, attention_backend=config.attention_backend, seed=config.seed)
    spec, params = load_params(model)
    rng = np.random.default_rng(config.seed)
    blocks_per_seq = -(-config.context_len // config.block_size)
    num_blocks = config.num_seqs * blocks_per_seq + 1
    tables = scattered_tables(rng, [blocks_per_seq] * config.num_seqs, num_blocks)
    contexts = [rng.integers(1, spec.vocab_size, config.context_len).tolist() for _ in range(config.num_seqs)]
    # Exactly num_seqs rows, unpadded: the batch the config asks for.
    plan = plan_from_contexts(contexts, [1] * config.num_seqs, tables, config.block_size,
                              shape=(config.num_seqs, config.num_seqs, blocks_per_seq))
    runner = ModelRunner(spec, params, block_size=config.block_size, attention_backend=config.attention_backend)
    pool = init_kv_pool(spec, num_blocks, config.block_size, params["embed"]["embedding"].dtype)
    wall, cpu = [], []
    for step in tqdm(range(config.warmup_steps + config.steps + 1), desc=f"decode {name}", mininterval=2.0):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        logits, pool = runner.step(pool, plan)
        logits.block_until_ready()
        if step > config.warmup_steps:  # step 0 compiles
            wall.append(time.perf_counter() - start_wall)
            cpu.append(time.process_time() - start_cpu)
    return {"model": name, "wall_us_per_step": 1e6 * statistics.median(wall),
            "cpu_us_per_step": 1e6 * statistics.fmean(cpu), "num_compilations": runner.num_compilations}


def run(config: BenchDecodeConfig) -> dict:
    """Benchmarks every model; writes and returns {"models": [...], "provenance": ...}."""
    rows = [bench_model(config, name) for name in config.models]
    for row in rows:
        print(f"{row['model']:<14} wall_us_per_step {row['wall_us_per_step']:10.1f}   "
              f"cpu_us_per_step {row['cpu_us_per_step']:10.1f}")
    result = {"models": rows, "num_devices": jax.device_count(), "provenance": provenance(config, seed=config.seed)}
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], BenchDecodeConfig, run, "configs/bench_decode.yaml")
