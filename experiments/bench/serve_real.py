"""The real engine on this machine vs static batching over a contiguous cache, same model and requests.

A ShareGPT-shaped offline workload, lengths scaled down to fit a CPU, runs through LLMEngine (paged
KV cache, iteration-level scheduling) and through StaticBatchGenerator (the Hugging Face `generate`
way: pad each batch, run it to its longest request, KV reserved for the longest sequence). Both
get the same KV memory; both decode greedily with the same weights, so outputs must match. Each
system runs the workload twice and the second (compiled) run is timed.

    python -m experiments.bench.serve_real --config configs/serve_real.yaml
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from experiments.common import REPO_ROOT, main, provenance, write_json
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.core.padding import bucket
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.executors.jax import JaxExecutor
from jpaged.paper.baselines.static_batching import StaticBatchGenerator
from jpaged.paper.workloads import sample_lengths

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServeRealConfig:
    """Workload, model and memory budget of the comparison."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(name="opt-125m"))
    num_requests: int = 64  # offline: all requests arrive at once
    length_scale: float = 0.125  # ShareGPT lengths are multiplied by this (CPU-sized requests)
    max_model_len: int = 256  # prompt + output cap after scaling
    baseline_batch_size: int = 16  # static batching: rows per batch (each reserves max_model_len slots)
    max_num_seqs: int = 64  # paged engine: most sequences per step
    block_size: int = 16
    seed: int = 0
    output: str = "results/serve_real.json"

    def __post_init__(self) -> None:
        if not 0 < self.length_scale <= 1:
            raise ValueError(f"length_scale must be in (0, 1], got {self.length_scale}")
        for name in ("num_requests", "baseline_batch_size", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def make_requests(config: ServeRealConfig, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """Scaled ShareGPT-shaped (prompt token ids, output lengths), seeded."""
    rng = np.random.default_rng(config.seed)
    prompt_lens, output_lens = sample_lengths("sharegpt", config.num_requests, rng)
    prompt_lens = np.clip(np.round(prompt_lens * config.length_scale), 2, config.max_model_len // 2).astype(int)
    output_lens = np.clip(np.round(output_lens * config.length_scale), 1,
                          config.max_model_len - prompt_lens).astype(int)
    prompts = [rng.integers(4, vocab_size, n).tolist() for n in prompt_lens]
    return prompts, output_lens.tolist()


def _run_paged(config: ServeRealConfig, prompts, output_lens, kv_slots: int) -> tuple[list, float, int]:
    engine_config = EngineConfig(
        model=config.model,
        cache=CacheConfig(block_size=config.block_size, num_blocks=kv_slots // config.block_size + 1,
                          num_host_blocks=0),
        scheduler=SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=4096,
                                  max_model_len=config.max_model_len))
    executor = JaxExecutor(engine_config)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in output_lens]
    times = []
    for _ in range(2):  # the first run compiles; the second is timed
        engine = LLMEngine(engine_config, executor=executor)
        start = executor.now()
        outputs = engine.generate(prompts, params)
        times.append(executor.now() - start)
    return [o.output_token_ids[0] for o in outputs], times[-1], executor.num_compilations


def run(config: ServeRealConfig) -> dict:
    """Serves the workload with both systems; returns output tok/s of each and their ratio."""
    from jpaged.models.checkpoint import load_params, resolve_dtype

    spec, weights = load_params(config.model)
    prompts, output_lens = make_requests(config, spec.vocab_size)
    # The baseline reserves max_model_len (rounded to its buckets) per row; the paged engine gets
    # the same number of KV slots as a pool of blocks.
    kv_slots = config.baseline_batch_size * bucket(config.max_model_len)
    paged_out, paged_s, paged_compiles = _run_paged(config, prompts, output_lens, kv_slots)
    baseline = StaticBatchGenerator(spec, weights, resolve_dtype(config.model.dtype))
    baseline.generate(prompts, output_lens, config.baseline_batch_size)  # compile
    baseline_out, baseline_s = baseline.generate(prompts, output_lens, config.baseline_batch_size)
    total = int(sum(output_lens))
    mismatches = sum(a != b for a, b in zip(paged_out, baseline_out))
    result = {
        "paged_tok_s": total / paged_s,
        "baseline_tok_s": total / baseline_s,
        "ratio": baseline_s / paged_s,
        "paged_s": paged_s,
        "baseline_s": baseline_s,
        "output_tokens": total,
        "kv_slots": kv_slots,
        "paged_compilations": paged_compiles,
        "baseline_compilations": baseline.num_compilations,
        "outputs_differ": mismatches,
        "target_ratio": 2.0,
        "provenance": provenance(config, seed=config.seed),
    }
    print("\n".join(f"{k:<22}{v:.3f}" if isinstance(v, float) else f"{k:<22}{v}"
                    for k, v in result.items() if k != "provenance"))
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], ServeRealConfig, run, "configs/serve_real.yaml")
