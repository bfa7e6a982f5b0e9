"""Host overhead of serving: scheduler + block manager + StepPlan building + token bookkeeping, no model.

An offline ShareGPT-shaped trace (every request at time 0) runs through the real LLMEngine with an
executor that does no work (every sampled token is a constant), so the time is all host-side
Python + numpy. For each scheduling policy it reports wall and CPU microseconds per
sequence-step: the cost the host adds to every token of every running sequence. The peer
comparison (nano-vllm's scheduler, interleaved runs) is experiments.peers.bench_host_peer.

    python -m experiments.bench.bench_host --config configs/bench_host.yaml
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time

import numpy as np
from tqdm.auto import tqdm

from experiments.common import REPO_ROOT, main, provenance, write_json
from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.core.sequence import SamplingParams
from jpaged.core.step_plan import ModelOutput, StepPlan
from jpaged.engine import EngineObserver, LLMEngine
from jpaged.paper.sim.executor import SIMULATED_TOKEN, synthetic_candidates

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BenchHostConfig:
    """The offline trace and the engine limits (OPT-13B on one A100-40GB by default)."""

    num_requests: int = 2000  # requests, all arriving at time 0
    prompt_mu: float = 4.6  # prompt length ~ LogNormal(mu, sigma), clipped to [4, 1024]
    prompt_sigma: float = 0.9
    output_mu: float = 5.3  # output length ~ LogNormal(mu, sigma), clipped to [4, max_model_len - prompt]
    output_sigma: float = 0.9
    num_samples: int = 1  # n per request; > 1 exercises fork and copy-on-write
    seed: int = 0
    policies: list[str] = dataclasses.field(default_factory=lambda: ["paper", "chunked"])  # scheduler.policy runs
    # Also time each step and sort the steps by kind (decode only / admits / preempts / finishes a
    # request): where the host time goes. Adds a clock read per step, so the peer comparison leaves it off.
    breakdown: bool = False
    cache: CacheConfig = dataclasses.field(default_factory=lambda: CacheConfig(
        block_size=16, num_blocks=984, num_host_blocks=984, enable_prefix_caching=True))  # 983 usable blocks x 16 = 15,728 slots
    scheduler: SchedulerConfig = dataclasses.field(default_factory=lambda: SchedulerConfig(
        max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048, preemption_mode="swap"))
    output: str = "results/bench_host.json"  # where the JSON result goes (relative to the repo root)

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if not self.policies or any(p not in ("paper", "chunked") for p in self.policies):
            raise ValueError(f"policies must list 'paper' and/or 'chunked', got {self.policies}")


class NullExecutor:
    """An executor that runs nothing: zero duration, the simulator's synthetic samples."""

    vocab_size = None  # any token id
    num_compilations = 0

    def execute(self, plan: StepPlan) -> ModelOutput:
        """Returns at once."""
        rows = plan.sampling
        if rows is None:
            return ModelOutput(token_ids=[], logprobs=None, top_ids=None, top_logprobs=None, duration=0.0)
        top_ids, top_logprobs = synthetic_candidates(rows) if rows.num_top else (None, None)
        return ModelOutput(token_ids=[SIMULATED_TOKEN] * len(rows.seqs), logprobs=None, top_ids=top_ids,
                           top_logprobs=top_logprobs, duration=0.0)

    def now(self) -> float:
        """A clock that never moves: the whole trace arrives at time 0."""
        return 0.0


def make_trace(config: BenchHostConfig) -> tuple[np.ndarray, np.ndarray]:
    """(prompt lengths, output lengths) of the offline trace, seeded."""
    rng = np.random.default_rng(config.seed)
    max_len = config.scheduler.max_model_len
    prompts = np.clip(np.round(rng.lognormal(config.prompt_mu, config.prompt_sigma, config.num_requests)),
                      4, 1024).astype(int)
    outputs = np.round(rng.lognormal(config.output_mu, config.output_sigma, config.num_requests)).astype(int)
    return prompts, np.clip(outputs, 4, max_len - prompts)


def serve(config: BenchHostConfig, policy: str, prompts: list[list[int]], outputs: list[int],
          show_progress: bool = True) -> dict:
    """Serves the trace with `policy` and no model; returns steps, sequence-steps and the wall and CPU
    seconds of the serving loop (admission of the requests excluded)."""
    scheduler = dataclasses.replace(config.scheduler, policy=policy)
    engine = LLMEngine(EngineConfig(cache=config.cache, scheduler=scheduler, executor="sim"), executor=NullExecutor())
    params = dict(n=config.num_samples, temperature=1.0 if config.num_samples > 1 else 0.0, ignore_eos=True)
    for i, (prompt, output_len) in enumerate(zip(prompts, outputs)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=output_len, **params), arrival_time=0.0)
    bar = tqdm(total=len(prompts), desc=f"bench_host {policy}", mininterval=1.0, disable=not show_progress)
    # What the process already holds (other experiments, under reproduce_all) is frozen out of the
    # cyclic GC, as vLLM does after start-up: the timing is the engine's, not the heap's size.
    kinds = StepKinds(engine) if config.breakdown else None
    gc.collect()
    gc.freeze()
    step = engine.step if kinds is None else kinds.step
    wall, cpu = time.perf_counter(), time.process_time()
    if show_progress:
        while engine.has_unfinished():
            bar.update(len(step()))
    else:  # (the peer's loop has no bar to update either)
        while engine.has_unfinished():
            step()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    gc.unfreeze()
    bar.close()
    stats = engine.kv_stats()
    seq_steps = engine.num_seq_steps
    return {"policy": policy, "steps": engine.num_steps, "seq_steps": seq_steps, "wall_s": wall, "cpu_s": cpu,
            "us_per_seq_step": wall / seq_steps * 1e6, "cpu_us_per_seq_step": cpu / seq_steps * 1e6,
            "num_preemptions": stats["num_preemptions"], "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
            **({"step_kinds": kinds.summary()} if kinds is not None else {})}


class StepKinds(EngineObserver):
    """Times every step (wall clock, the whole of `engine.step()`) and files it under its kind:
    what the step's scheduling did (admitted, preempted) and whether a request finished in it."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.kind = "decode"
        self.totals: dict[str, list[float]] = {}  # kind -> [steps, seconds]
        engine.observers.append(self)

    def on_step_end(self, engine, out, outputs, end) -> None:
        """Names the step that just ended."""
        kind = "+".join(name for name, happened in (("admit", out.admitted), ("preempt", out.num_preempted),
                                                    ("finish", any(o.finished for o in outputs))) if happened)
        self.kind = kind or "decode"

    def step(self) -> list:
        """One timed `engine.step()`."""
        start = time.perf_counter()
        outputs = self.engine.step()
        total = self.totals.setdefault(self.kind, [0, 0.0])
        total[0] += 1
        total[1] += time.perf_counter() - start
        return outputs

    def summary(self) -> dict:
        """Per kind: steps, share of the loop's time, and microseconds per step."""
        loop = sum(seconds for _, seconds in self.totals.values())
        return {kind: {"steps": steps, "share": seconds / loop, "us_per_step": seconds / steps * 1e6}
                for kind, (steps, seconds) in sorted(self.totals.items(), key=lambda item: -item[1][1])}


def trace_prompts(config: BenchHostConfig) -> tuple[list[list[int]], list[int]]:
    """The trace's prompts (distinct random ids: with prefix caching on, hits would otherwise be
    spurious) and output lengths."""
    prompt_lens, outputs = make_trace(config)
    rng = np.random.default_rng(config.seed + 1)
    return [rng.integers(0, 50272, p).tolist() for p in prompt_lens.tolist()], outputs.tolist()


def run(config: BenchHostConfig) -> dict:
    """Serves the trace once per policy; returns (and writes) the per-policy host costs."""
    prompts, outputs = trace_prompts(config)
    runs = [serve(config, policy, prompts, outputs) for policy in config.policies]
    result = {"runs": runs, "num_requests": config.num_requests,
              "provenance": provenance(config, seed=config.seed, device="host (no model)")}
    for r in runs:
        print(f"{r['policy']:<8} steps {r['steps']}  seq_steps {r['seq_steps']}  "
              f"us_per_seq_step {r['us_per_seq_step']:.3f} (cpu {r['cpu_us_per_seq_step']:.3f})  "
              f"wall_s {r['wall_s']:.2f}  num_preemptions {r['num_preemptions']}")
        for kind, row in r.get("step_kinds", {}).items():
            print(f"    {kind:<22} steps {row['steps']:>6}  {row['share']:6.1%} of the loop  "
                  f"{row['us_per_step']:7.1f} us/step")
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], BenchHostConfig, run, "configs/bench_host.yaml")
