"""Sampler micro-benchmark: one jitted sampling call per path, per batch size, wall and CPU time.

    python -m experiments.bench.bench_sampler --config configs/bench_sampler.yaml

Each path of jpaged.executors.sampling (greedy; temperature alone; min_p; top-p by bisection;
top-k among candidates, with top-p; top-k above the candidate limit; the controls) samples R
rows of random logits over the asset model's vocabulary, with the per-row data at the widths an
engine of `max_model_len` gives (one program per batch size serves every path). Then the
paths run interleaved `rounds` times, `calls` calls each; the median wall time and the mean CPU
time per call are reported. Saved to results/bench_sampler.json.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from experiments.common import REPO_ROOT, main, provenance, write_json
from jpaged.core.sequence import SamplingParams, Sequence, SequenceGroup
from jpaged.core.step_plan import SampleRows
from jpaged.executors.sampling import SamplerWidths, sample, sampler_widths

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BenchSamplerConfig:
    """The vocabulary, the batch sizes and the sampling settings of each path."""

    vocab_size: int = 4096  # assets/stdlib-lm's
    max_model_len: int = 2048  # with the largest batch size as max_num_seqs: the sampler's fixed widths
    batch_sizes: tuple[int, ...] = (8, 64, 256)
    # path name -> SamplingParams fields of every row (a seed and a 200-token history are added)
    paths: dict[str, dict[str, Any]] = dataclasses.field(default_factory=lambda: {
        "greedy": {}, "temperature": {"temperature": 1.0}})
    calls: int = 20  # timed calls per path per round
    rounds: int = 3
    seed: int = 0
    output: str = "results/bench_sampler.json"

    def __post_init__(self) -> None:
        if min(self.calls, self.rounds, self.vocab_size, *self.batch_sizes) < 1:
            raise ValueError("calls, rounds, vocab_size and batch_sizes must be >= 1")


def sample_rows(num_rows: int, fields: dict[str, Any], rng: np.random.Generator, vocab: int) -> SampleRows:
    """R sample rows of fresh one-sequence requests with `fields`, each holding a 100-token prompt and
    100 output tokens (what penalties read)."""
    seqs = []
    for r in range(num_rows):
        seq = Sequence(r, rng.integers(0, vocab, 100).tolist())
        SequenceGroup(f"r{r}", [seq], SamplingParams(seed=r, max_tokens=1000, **fields), 0.0, r, eos_token_ids=(0,))
        seq.token_ids += rng.integers(0, vocab, 100).tolist()
        seqs.append(seq)
    return SampleRows(seqs=seqs, logits_rows=np.arange(num_rows, dtype=np.int32), indices=None, num_top=0,
                      is_plain=True, first_token_groups=[])


def time_calls(logits, rows: SampleRows, calls: int, widths: SamplerWidths) -> tuple[float, float]:
    """(median wall ms, mean CPU ms) per call of `sample` at an engine's `widths`, the host's batch
    arrays built each call."""
    wall, cpu = [], []
    for _ in range(calls):
        rows.__dict__.pop("batch", None)  # SampleRows.batch is cached: a step builds it once
        start, start_cpu = time.perf_counter(), time.process_time()
        sample(logits, rows.batch, widths)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return 1e3 * statistics.median(wall), 1e3 * statistics.fmean(cpu)


def run(config: BenchSamplerConfig) -> dict:
    """Times every path at every batch size; returns and writes {"results": [...], ...}."""
    rng = np.random.default_rng(config.seed)
    widths = sampler_widths(config.max_model_len, max(config.batch_sizes), config.vocab_size)
    cases = []
    for size in config.batch_sizes:
        logits = jax.device_put(rng.normal(size=(size, config.vocab_size)).astype(np.float32) * 3)
        for name, fields in config.paths.items():
            rows = sample_rows(size, fields, rng, config.vocab_size)
            time_calls(logits, rows, 2, widths)  # compiles (once per batch size: one program serves every path)
            cases.append((size, name, logits, rows))
    times: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for _ in tqdm(range(config.rounds), desc="rounds"):
        for size, name, logits, rows in cases:
            times.setdefault((size, name), []).append(time_calls(logits, rows, config.calls, widths))
    results = []
    for (size, name), values in times.items():
        results.append({"rows": size, "path": name, "wall_ms": statistics.median(w for w, _ in values),
                        "cpu_ms": statistics.median(c for _, c in values)})
    print(f"{'path':<26}" + "".join(f"{'R=' + str(s) + ' wall/cpu ms':>22}" for s in config.batch_sizes))
    for name in config.paths:
        cells = [next(r for r in results if r["rows"] == s and r["path"] == name) for s in config.batch_sizes]
        print(f"{name:<26}" + "".join(f"{c['wall_ms']:14.2f} / {c['cpu_ms']:5.2f}" for c in cells))
    result = {"results": results, "load_average": os.getloadavg(), "provenance": provenance(config, seed=config.seed)}
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], BenchSamplerConfig, run, "configs/bench_sampler.yaml")
