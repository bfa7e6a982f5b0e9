"""What sampling costs against greedy per output token, offline, through the real engine (issue 31).

    python -m experiments.bench.sampling_cost --config configs/sampling_cost.yaml

The workload of `vllm bench serve --dataset-name random` (random 128-token prompts, 128 output
tokens each, `ignore_eos`), served by `LLM.generate` on the asset model under each sampling
condition of the config: greedy (the baseline), temperature 1 (the benchmark client's default),
and the common filters and controls. One warm-up run per condition compiles its shapes; then the
conditions run interleaved, each repeat rotating which goes first. Per run: output tokens, wall
and CPU seconds (all threads of this process), the load average; per repeat, each condition's
wall and CPU time per output token over greedy's. Saved to results/sampling_cost.json.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from experiments.common import REPO_ROOT, main, provenance, write_json
from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints.llm import LLM

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SamplingCostConfig:
    """The model, its engine arguments, the workload and the sampling conditions."""

    model: str = "assets/stdlib-lm"
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # engine arguments (jpaged.entrypoints.engine_args)
    num_prompts: int = 100
    prompt_len: int = 128
    output_len: int = 128
    # condition name -> SamplingParams fields (max_tokens, ignore_eos and seed are the workload's)
    conditions: dict[str, dict[str, Any]] = dataclasses.field(
        default_factory=lambda: {"greedy": {}, "temperature_1": {"temperature": 1.0}})
    baseline: str = "greedy"
    repeats: int = 3
    seed: int = 0
    output: str = "results/sampling_cost.json"

    def __post_init__(self) -> None:
        if min(self.repeats, self.num_prompts, self.prompt_len, self.output_len) < 1:
            raise ValueError("repeats, num_prompts, prompt_len and output_len must be >= 1")
        if self.baseline not in self.conditions:
            raise ValueError(f"baseline: {self.baseline!r} is not one of the conditions {list(self.conditions)}")


def workload_params(config: SamplingCostConfig, condition: dict[str, Any]) -> list[SamplingParams]:
    """One SamplingParams per prompt: the condition's fields, the workload's length, a seed each."""
    return [SamplingParams(max_tokens=config.output_len, ignore_eos=True, seed=config.seed + i, **condition)
            for i in range(config.num_prompts)]


def run_once(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """One timed LLM.generate of the workload."""
    load_before = os.getloadavg()
    cpu, start = time.process_time(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens": tokens, "wall_s": wall, "cpu_s": cpu, "output_tok_s": tokens / wall,
            "wall_ms_per_token": 1e3 * wall / tokens, "cpu_ms_per_token": 1e3 * cpu / tokens,
            "load_average_before": load_before, "load_average_after": os.getloadavg()}


def run(config: SamplingCostConfig) -> dict:
    """Warm-up, then interleaved timed runs of every condition; returns and writes the ratios."""
    llm = LLM(config.model, **config.engine)
    vocab = llm.engine.vocab_size
    rng = np.random.default_rng(config.seed)
    prompts = [rng.integers(0, vocab, config.prompt_len).tolist() for _ in range(config.num_prompts)]
    names = list(config.conditions)
    params = {name: workload_params(config, fields) for name, fields in config.conditions.items()}
    for name in tqdm(names, desc="warm-up"):
        run_once(llm, prompts, params[name])
    runs: list[dict] = []
    bar = tqdm(total=config.repeats * len(names), desc="timed runs")
    for repeat in range(config.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:  # rotate who goes first
            result = run_once(llm, prompts, params[name])
            runs.append({"repeat": repeat, "condition": name, **result})
            bar.update()
            bar.set_postfix(condition=name, tok_s=f"{result['output_tok_s']:.0f}")
    bar.close()

    def of(repeat: int, name: str) -> dict:
        return next(r for r in runs if r["repeat"] == repeat and r["condition"] == name)

    summary: dict[str, Any] = {}
    for name in names:
        wall = [of(i, name)["wall_ms_per_token"] / of(i, config.baseline)["wall_ms_per_token"]
                for i in range(config.repeats)]
        cpu = [of(i, name)["cpu_ms_per_token"] / of(i, config.baseline)["cpu_ms_per_token"]
               for i in range(config.repeats)]
        mine = [r for r in runs if r["condition"] == name]
        summary[name] = {"output_tok_s_median": statistics.median(r["output_tok_s"] for r in mine),
                         "wall_ms_per_token_median": statistics.median(r["wall_ms_per_token"] for r in mine),
                         "cpu_ms_per_token_median": statistics.median(r["cpu_ms_per_token"] for r in mine),
                         "wall_ratio_over_baseline_median": statistics.median(wall), "wall_ratios": wall,
                         "cpu_ratio_over_baseline_median": statistics.median(cpu), "cpu_ratios": cpu}
    summary["target"] = "temperature 1 costs <= 1.2x greedy per output token (issue 31)"
    print(f"{'condition':<22}{'tok/s':>9}{'wall ms/tok':>13}{'cpu ms/tok':>12}{'wall ratio':>12}{'cpu ratio':>11}")
    for name in names:
        s = summary[name]
        print(f"{name:<22}{s['output_tok_s_median']:9.0f}{s['wall_ms_per_token_median']:13.3f}"
              f"{s['cpu_ms_per_token_median']:12.3f}{s['wall_ratio_over_baseline_median']:12.2f}"
              f"{s['cpu_ratio_over_baseline_median']:11.2f}")
    result = {"summary": summary, "runs": runs, "provenance": provenance(config, seed=config.seed)}
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], SamplingCostConfig, run, "configs/sampling_cost.yaml")
