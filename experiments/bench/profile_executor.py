"""Profile the real executor and set the simulator's cost models beside what it measures.

The Vidur approach (jpaged.paper.sim.profiled): the JaxExecutor runs a grid of step shapes (decode
batches x contexts, prompts, batches of prompts, prompts beside decodes; each compiled first,
then the fastest of `repeats`); the profiled cost model is fitted on every other shape and
checked on the rest (held out). With `gpu` set (on a GPU: the spec of the device the run is on),
the roofline CostModel prices every shape too, so the result gives simulated / measured per shape
for both models. On this CPU it validates the method on a small model; on a GPU (a 1B-class
preset, dummy weights) it is issue 16's simulated-vs-measured check.

    python -m experiments.bench.profile_executor --config configs/profile_executor.yaml
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
from typing import Callable

import numpy as np

from experiments.common import REPO_ROOT, main, provenance, write_json
from experiments.paged_batch import plan_from_contexts
from jpaged.config import CacheConfig, EngineConfig, ModelConfig
from jpaged.core.step_plan import StepPlan
from jpaged.paper.sim.cost_model import CostModel, CostModelConfig
from jpaged.paper.sim.gpus import get_gpu
from jpaged.paper.sim.profiled import FittedCostModel, ProfileSample

logger = logging.getLogger(__name__)


def synthetic_plan(query_lens: list[int], context_lens: list[int], *,
                   block_size: int, num_blocks: int, vocab_size: int) -> StepPlan:
    """A well-formed StepPlan of the given shape, padded like the scheduler pads, for timing.

    Sequences get consecutive blocks from 1 upward, wrapping within the pool, so sequences may
    share blocks when the pool is small: harmless, the contents are never read back. The query
    tokens are ids 4, 5, ... (wrapping below `vocab_size`); the context before them is never read.
    """
    if not query_lens or len(query_lens) != len(context_lens) or not all(
            1 <= q <= c for q, c in zip(query_lens, context_lens)):
        raise ValueError("query_lens must be non-empty, each >= 1 and <= its context_lens")
    blocks = [-(-c // block_size) for c in context_lens]
    starts = np.cumsum([0] + blocks[:-1])
    tables = [(1 + (start + np.arange(b)) % (num_blocks - 1)).tolist() for start, b in zip(starts, blocks)]
    ids = (np.arange(sum(query_lens)) % (vocab_size - 4) + 4).tolist()
    ends = np.cumsum(query_lens).tolist()
    contexts = [[0] * (c - q) + ids[end - q: end] for q, c, end in zip(query_lens, context_lens, ends)]
    return plan_from_contexts(contexts, query_lens, tables, block_size)


def profile(execute: Callable[[StepPlan], float], *, block_size: int, num_blocks: int, vocab_size: int,
            decode_batches: tuple[int, ...] = (1, 4, 16, 64), decode_contexts: tuple[int, ...] = (64, 256, 1024),
            prefill_tokens: tuple[int, ...] = (16, 64, 256, 1024), repeats: int = 3) -> list[ProfileSample]:
    """Times `execute(plan) -> seconds` on a grid of shapes; one untimed run per shape compiles it.

    Decode: every (batch, context) pair. Prefill: one prompt of each length, and batches of four
    prompts of a quarter of each length (so the fit separates tokens from attention pairs). Mixed:
    one prompt of each length beside four decode rows of the middle decode context.
    """
    shapes = [([1] * b, [c] * b) for b, c in itertools.product(decode_batches, decode_contexts)]
    mid_context = decode_contexts[len(decode_contexts) // 2]
    for t in prefill_tokens:
        shapes.append(([t], [t]))
        if t >= 8:
            shapes.append(([t // 4] * 4, [t // 4] * 4))
        shapes.append(([t] + [1] * 4, [t] + [mid_context] * 4))
    samples = []
    for q, ctx in shapes:
        plan = synthetic_plan(q, ctx, block_size=block_size, num_blocks=num_blocks, vocab_size=vocab_size)
        execute(plan)
        best = min(execute(plan) for _ in range(repeats))
        samples.append(ProfileSample(tuple(q), tuple(ctx), best))
    return samples


@dataclasses.dataclass(frozen=True)
class ProfileExecutorConfig:
    """The model, its pool, the shape grid, and the GPU spec the roofline prices."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="opt-125m"))  # dummy weights
    block_size: int = 16  # KV block size
    num_blocks: int = 1025  # pool blocks (block 0 reserved); shapes wrap inside it
    decode_batches: list[int] = dataclasses.field(default_factory=lambda: [1, 4, 16, 64])  # decode grid: batch
    decode_contexts: list[int] = dataclasses.field(default_factory=lambda: [64, 256, 1024])  # ... x context
    prefill_tokens: list[int] = dataclasses.field(default_factory=lambda: [16, 64, 256, 1024])  # prompt lengths
    repeats: int = 3  # timed runs per shape after the compiling one (the fastest counts)
    gpu: str | None = None  # jpaged.paper.sim.gpus spec the roofline prices (the device's); null: no roofline
    output: str = "results/profile_executor.json"  # results JSON, relative to the repo root

    def __post_init__(self) -> None:
        for name in ("decode_batches", "decode_contexts", "prefill_tokens"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be a non-empty list of values >= 1, got {values}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.gpu is not None:
            get_gpu(self.gpu)  # ValueError naming the known specs


def run(config: ProfileExecutorConfig) -> dict:
    """Profiles, fits on every other shape, and compares; writes and returns the result."""
    from jpaged.executors.jax import JaxExecutor

    cache = CacheConfig(block_size=config.block_size, num_blocks=config.num_blocks, num_host_blocks=0)
    executor = JaxExecutor(EngineConfig(model=config.model, cache=cache))
    spec = executor.spec
    samples = profile(lambda plan: executor.execute(plan).duration, block_size=config.block_size,
                      num_blocks=config.num_blocks, vocab_size=spec.vocab_size,
                      decode_batches=tuple(config.decode_batches), decode_contexts=tuple(config.decode_contexts),
                      prefill_tokens=tuple(config.prefill_tokens), repeats=config.repeats)
    gpu = get_gpu(config.gpu or "a100-40gb")  # the roofline also models the (unprofiled) swap and copy times
    roofline = CostModel(spec, gpu, CostModelConfig(), dtype=config.model.dtype if config.model.dtype != "auto"
                         else "float32", block_size=config.block_size)
    fit = FittedCostModel(samples[::2], roofline)
    rows = []
    for i, s in enumerate(samples):
        q, ctx = np.array(s.query_lens), np.array(s.context_lens)
        row = {"query_lens": list(s.query_lens), "context_lens": list(s.context_lens), "measured_s": s.seconds,
               "held_out": i % 2 == 1, "fitted_s": fit.step_time(q, ctx)}
        if config.gpu is not None:
            row["roofline_s"] = roofline.step_time(q, ctx)
        rows.append(row)
    held = [r for r in rows if r["held_out"]]
    errors = [abs(r["fitted_s"] / r["measured_s"] - 1) for r in held]
    summary = {"held_out_median_abs_error": float(np.median(errors)), "held_out_max_abs_error": float(max(errors))}
    if config.gpu is not None:
        ratios = [r["roofline_s"] / r["measured_s"] for r in rows]
        summary |= {"roofline_over_measured_median": float(np.median(ratios)),
                    "roofline_over_measured_min": float(min(ratios)), "roofline_over_measured_max": float(max(ratios))}
    result = {"rows": rows, "summary": summary, "fit_coef": fit.coef.tolist(), "load_average": os.getloadavg(),
              "provenance": provenance(config)}
    write_json(REPO_ROOT / config.output, result)
    for key, value in summary.items():
        print(f"{key:<34} {value:.3f}")
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], ProfileExecutorConfig, run, "configs/profile_executor.yaml")
