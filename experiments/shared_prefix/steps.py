"""Where Fig. 16's ratio comes from: the steps of vLLM and Orca (Oracle) at their sustained rates.

For each prefix, each system is served at its sustained rate from the committed figure
(`sustained_from`, results/shared_prefix.json), and vLLM also at the rate the paper's ratio would
require (paper ratio x Orca (Oracle)'s sustained rate). Every executed step is measured
(`StepMeter`): prompt steps (some row computes more than one token) apart from decode steps, the
sequences and tokens in each, the prompt tokens computed, the KV blocks held, the cost model's
seconds per part (gemm, elementwise, attention, communication, host) and the step's GEMM time over
the weight-read floor of a one-token step (about 1: the GEMMs are memory-bound, reading weights;
well above 1: compute-bound). Per request: the step seconds it costs, by part, against the
1 / rate a sustained rate allows.

    python -m experiments.shared_prefix.steps --config configs/shared_prefix_steps.yaml
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np

from experiments import common
from experiments.common import REPO_ROOT, provenance, sha256_of, write_json
from experiments.shared_prefix import SharedPrefixConfig, run_point
from jpaged.config import load_config
from jpaged.engine import LLMEngine
from jpaged.paper.sim.cost_model import PARTS

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SharedPrefixStepsConfig:
    """The figure's config, the committed sustained rates, and the paper's ratios per prefix."""

    base: str = "configs/shared_prefix.yaml"  # Fig. 16's config (model, workload, cache, scheduler)
    sustained_from: str = "results/shared_prefix.json"  # the committed figure: each system's sustained rate
    paper_ratio: dict[str, float] = dataclasses.field(default_factory=lambda: {"80": 1.67, "341": 3.58})
    duration_s: float = 120.0  # trace length per point, seconds (steady state is reached within ~20 s)
    output: str = "results/shared_prefix_steps.json"

    def __post_init__(self) -> None:
        if not self.duration_s > 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        for prefix, ratio in self.paper_ratio.items():
            if not (prefix.isdigit() and ratio > 0):
                raise ValueError(f"paper_ratio.{prefix} must map a prefix length to a ratio > 0, got {ratio}")


class StepMeter:
    """Step observer: per kind of step (prompt, decode), duration-weighted sums of the batch, its
    tokens, the KV blocks held, the cost model's parts and the GEMMs' distance from memory-bound."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.cost = engine.executor.cost_model
        one = np.ones(1, np.int32)
        self.gemm_floor_s = self.cost.breakdown(one, one)["gemm"]  # weights read once, one token
        self.pool_blocks = engine.config.cache.num_blocks - 1  # block 0 is reserved
        self.sums = {kind: dict.fromkeys(("time_s", "steps", "seqs", "tokens", "prompt_tokens", "kv_blocks",
                                          "gemm_over_floor", *PARTS), 0.0) for kind in ("prompt", "decode")}

    def __call__(self, start: float, plan) -> None:
        """Adds one executed step (run_trace calls it after the step ran)."""
        if not plan.num_seqs:
            return
        dt = self.engine.executor.now() - start
        query = np.asarray(plan.query_lens[: plan.num_seqs])
        context = np.asarray(plan.context_lens[: plan.num_seqs])
        parts = self.cost.breakdown(query, context)
        s = self.sums["prompt" if (query > 1).any() else "decode"]
        held = self.pool_blocks - self.engine.scheduler.block_manager.num_free_blocks
        s["time_s"] += dt
        s["steps"] += 1
        s["prompt_tokens"] += float(query[query > 1].sum())
        for key, value in (("seqs", len(query)), ("tokens", float(query.sum())), ("kv_blocks", held),
                           ("gemm_over_floor", parts["gemm"] / self.gemm_floor_s)):
            s[key] += value * dt  # duration-weighted: their means weigh each step by how long it ran
        for part, seconds in parts.items():
            s[part] += seconds  # the step's seconds per part (they sum to its model time)

    def summary(self, completed: int) -> dict:
        """Per kind: its share of the busy time, duration-weighted means, and seconds per request by part."""
        busy = sum(s["time_s"] for s in self.sums.values())
        out = {"busy_ms_per_request": 1e3 * busy / max(completed, 1),
               "prompt_tokens_per_request": self.sums["prompt"]["prompt_tokens"] / max(completed, 1)}
        for kind, s in self.sums.items():
            t = s["time_s"] or 1.0
            out[kind] = {"time_share": s["time_s"] / busy if busy else 0.0, "steps": int(s["steps"]),
                         "mean_seqs": s["seqs"] / t, "mean_tokens": s["tokens"] / t,
                         "kv_held_fraction": s["kv_blocks"] / t / self.pool_blocks,
                         "gemm_over_floor": s["gemm_over_floor"] / t,
                         "ms_per_request": {p: 1e3 * s[p] / max(completed, 1) for p in PARTS}}
        return out


def run(config: SharedPrefixStepsConfig) -> dict:
    """Measures every (prefix, system, rate) point; writes and returns the JSON."""
    base = load_config(REPO_ROOT / config.base, SharedPrefixConfig)
    fig = dataclasses.replace(base, duration_s=config.duration_s)
    sustained = json.loads((REPO_ROOT / config.sustained_from).read_text())["sustained_rate"]
    points = []
    for prefix in fig.prefix_lens:
        rates = sustained[str(prefix)]
        required = config.paper_ratio[str(prefix)] * rates["orca_oracle"]
        for system, rate, role in (("orca_oracle", rates["orca_oracle"], "sustained"),
                                   ("vllm", rates["vllm"], "sustained"), ("vllm", required, "paper_ratio")):
            meters: list[StepMeter] = []

            def observe(engine: LLMEngine) -> StepMeter:
                meters.append(StepMeter(engine))
                return meters[-1]

            point = run_point(fig, prefix, system, rate, observe=observe)
            point |= {"role": role, "steps": meters[0].summary(point["completed"])}
            points.append(point)
            st = point["steps"]
            print(f"{prefix:>4} {system:<12} {role:<11} {rate:6.2f} req/s  busy {st['busy_ms_per_request']:6.2f} ms/req "
                  f"(1/rate {1e3 / rate:6.2f})  prompt steps {100 * st['prompt']['time_share']:4.1f}% of time, "
                  f"{st['prompt']['mean_seqs']:5.1f} seqs {st['prompt']['mean_tokens']:6.0f} tokens; decode "
                  f"{st['decode']['mean_seqs']:5.1f} seqs; KV held {100 * st['decode']['kv_held_fraction']:4.1f}%")
    result = {"points": points, "paper_ratio": config.paper_ratio,
              "sustained_from": {"path": config.sustained_from, "sha256": sha256_of(REPO_ROOT / config.sustained_from)},
              "provenance": provenance(config, seed=fig.seed, device=f"simulated {fig.sim.tp}x {fig.sim.gpu}")}
    write_json(REPO_ROOT / config.output, result)
    return result


def main() -> None:
    """The command line: `python -m experiments.shared_prefix.steps [--config ...]`."""
    logging.basicConfig(level=logging.WARNING)
    common.main(__doc__.splitlines()[0], SharedPrefixStepsConfig, run, "configs/shared_prefix_steps.yaml")


if __name__ == "__main__":
    main()
