"""Record where a trained model's beam search branches, for the simulator to replay (Figs. 14/15).

For every beam width, `num_traces` prompts (windows of the Python standard library's sources,
tokenized with the model's tokenizer: local text in the model's domain) run a real beam search on
the real executor, `max_tokens` steps each with EOS ignored, as the simulated requests do. At every
step the recorder keeps each beam's top 2 x width candidates (token ids and log-probabilities),
keyed by the beam's rank among its group's rows: exactly what the model handed the engine's beam
step. `jpaged.paper.sim.executor.BeamReplay` hands them back in the same order, so a simulated search
follows the recorded one. The summary JSON holds, per width, how the recorded searches branched
(distinct parents per step, the share of steps whose beams all continue one parent) beside the
same measures of the synthetic branching model on the same requests.

    python -m experiments.record_beams --config configs/record_beams.yaml
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sysconfig
from pathlib import Path
from typing import Literal

import numpy as np

from experiments import common
from experiments.common import REPO_ROOT, provenance, sha256_of, write_json
from experiments.serving import BranchingMeter
from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.core.outputs import RequestOutput
from jpaged.core.sequence import SamplingParams
from jpaged.engine import EngineObserver, LLMEngine
from jpaged.paper.sim.executor import SimExecutor, beam_rows

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RecordBeamsConfig:
    """The model, its prompts, and the searches to record."""

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig(
        name="stdlib-lm", checkpoint="assets/stdlib-lm", attention_backend="xla"))  # a trained model
    # stdlib: windows of the standard library's .py sources, tokenized by `tokenizer`; random: seeded
    # random token ids (only for tests on dummy weights, where no text means anything)
    prompts: Literal["stdlib", "random"] = "stdlib"
    tokenizer: str | None = None  # tokenizer.json; None: the one in model.checkpoint
    widths: list[int] = dataclasses.field(default_factory=lambda: [2, 4, 6])  # beam widths to record
    num_traces: int = 16  # recorded searches per width (simulated requests replay trace stream % K)
    prompt_len: int = 32  # tokens per prompt
    max_tokens: int = 448  # steps of every search (prompt_len + max_tokens <= the model's positions)
    max_num_seqs: int = 96  # beams run together in one batch
    num_blocks: int = 1024  # KV pool (blocks of 16; block 0 reserved)
    seed: int = 0  # picks the prompts
    output: str = "results/beam_traces.npz"  # the recorded candidates (BeamReplay's format)
    summary: str = "results/beam_traces.json"  # provenance, prompts, branching statistics

    def __post_init__(self) -> None:
        if not self.widths or min(self.widths) < 2:
            raise ValueError(f"widths must be a non-empty list of ints >= 2, got {self.widths}")
        if self.num_traces < 1 or self.prompt_len < 1 or self.max_tokens < 2:
            raise ValueError(f"num_traces >= 1, prompt_len >= 1 and max_tokens >= 2 required, got "
                             f"{self.num_traces}, {self.prompt_len}, {self.max_tokens}")
        if self.max_num_seqs < max(self.widths):
            raise ValueError(f"max_num_seqs must be >= the widest beam ({max(self.widths)}), got {self.max_num_seqs}")
        if self.prompts == "stdlib" and self.tokenizer is None and self.model.checkpoint is None:
            raise ValueError("prompts: stdlib needs a tokenizer (tokenizer, or model.checkpoint holding tokenizer.json)")


class BeamRecorder(EngineObserver):
    """Engine observer: every beam row's top candidates, by (trace, step, beam rank)."""

    def __init__(self, width: int, num_traces: int, length: int, trace_of: dict[str, int]):
        self.width = width
        self.trace_of = trace_of  # request id -> trace index
        self.ids = np.zeros((num_traces, length, width, 2 * width), np.int32)  # [K, L, n, 2n]
        self.logprobs = np.full((num_traces, length, width, 2 * width), -np.inf, np.float32)

    def on_step_executed(self, engine, out, result, start, end) -> None:
        """Copies the candidates the executor returned for the step's beam rows."""
        rows = out.plan.sampling
        if rows is None or result.top_ids is None:
            return
        top_ids, top_logprobs = np.asarray(result.top_ids), np.asarray(result.top_logprobs)
        k = 2 * self.width
        for r, seq, rank, _ in beam_rows(rows):
            trace, step = self.trace_of[seq.group.request_id], seq.num_output_tokens
            self.ids[trace, step, rank] = top_ids[r, :k]
            self.logprobs[trace, step, rank] = top_logprobs[r, :k]


def candidate_stats(logprobs: np.ndarray) -> dict[str, float]:
    """The recorded candidates' shape: mean log-probability of each beam's best candidate, and of
    the gap from its best to its second (rows that did not run, e.g. step 0's extra beams, skipped)."""
    rows = logprobs[np.isfinite(logprobs[..., 0])]  # [rows, 2n]
    return {"mean_top1_logprob": float(rows[:, 0].mean()), "mean_top1_top2_gap": float((rows[:, 0] - rows[:, 1]).mean())}


def stdlib_prompts(config: RecordBeamsConfig, count: int) -> tuple[list[list[int]], list[str]]:
    """`count` prompts of `prompt_len` tokens: seeded windows of seeded standard-library files;
    returns the prompts and, for each, "<file>:<first token>"."""
    from tokenizers import Tokenizer

    path = config.tokenizer or str(Path(config.model.checkpoint) / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(REPO_ROOT / path) if not Path(path).is_absolute() else path)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))
    rng = np.random.default_rng(config.seed)
    prompts, sources = [], []
    while len(prompts) < count:
        file = files[int(rng.integers(len(files)))]
        ids = tokenizer.encode(file.read_text(errors="replace"), add_special_tokens=False).ids
        if len(ids) < 2 * config.prompt_len:
            continue
        start = int(rng.integers(len(ids) - config.prompt_len))
        prompts.append(ids[start: start + config.prompt_len])
        sources.append(f"{file.name}:{start}")
    return prompts, sources


def make_prompts(config: RecordBeamsConfig, count: int, vocab_size: int) -> tuple[list[list[int]], list[str]]:
    """The prompts of `config.prompts` (see RecordBeamsConfig)."""
    if config.prompts == "stdlib":
        return stdlib_prompts(config, count)
    rng = np.random.default_rng(config.seed)
    return [rng.integers(4, vocab_size, config.prompt_len).tolist() for _ in range(count)], ["random"] * count


def engine_config(config: RecordBeamsConfig, executor: str) -> EngineConfig:
    """The engine every search runs on (the real model, or the simulator for the synthetic twin)."""
    scheduler = SchedulerConfig(max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max(2048, config.max_num_seqs),
                                max_model_len=config.prompt_len + config.max_tokens, policy="paper")
    cache = CacheConfig(block_size=16, num_blocks=config.num_blocks, num_host_blocks=0)
    return EngineConfig(model=config.model, cache=cache, scheduler=scheduler, executor=executor)


def search(engine: LLMEngine, prompts: list[list[int]], width: int,
           max_tokens: int) -> tuple[BranchingMeter, dict[str, RequestOutput]]:
    """Beam-searches every prompt to `max_tokens` (EOS ignored); returns how the searches branched
    and each request's final output (its beams, best first)."""
    meter = BranchingMeter()
    outputs: dict[str, RequestOutput] = {}
    engine.observers.append(meter)
    params = SamplingParams(n=width, use_beam_search=True, max_tokens=max_tokens, ignore_eos=True)
    for k, prompt in enumerate(prompts):
        engine.add_request(str(k), prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                raise RuntimeError(f"beam search of prompt {out.request_id} failed: {out.error}")
            outputs[out.request_id] = out
    engine.observers.remove(meter)
    return meter, outputs


def run(config: RecordBeamsConfig) -> dict:
    """Records every width's searches; writes the .npz and the summary JSON; returns the summary."""
    from jpaged.executors.jax import JaxExecutor
    from jpaged.paper.systems import make_scheduler

    real_config = engine_config(config, "jax")
    executor = JaxExecutor(real_config)
    prompts, sources = make_prompts(config, config.num_traces * len(config.widths), executor.vocab_size)
    arrays, widths = {}, {}
    for i, width in enumerate(config.widths):
        mine = prompts[i * config.num_traces: (i + 1) * config.num_traces]
        recorder = BeamRecorder(width, config.num_traces, config.max_tokens, {str(k): k for k in range(len(mine))})
        engine = LLMEngine(real_config, executor, make_scheduler("vllm", real_config))
        engine.observers.append(recorder)
        recorded, _ = search(engine, mine, width, config.max_tokens)
        # The synthetic model on the same requests, for the side-by-side branching statistics.
        sim_config = engine_config(config, "sim")
        sim = SimExecutor(executor.spec if config.model.checkpoint else get_preset(config.model.name))
        synthetic, _ = search(LLMEngine(sim_config, sim, make_scheduler("vllm", sim_config)), mine, width,
                              config.max_tokens)
        # Ids fit 16 bits for vocabularies under 32K (BeamReplay widens them): a smaller file to commit.
        small = executor.vocab_size < 2**15
        arrays[f"ids_{width}"] = recorder.ids.astype(np.int16) if small else recorder.ids
        arrays[f"logprobs_{width}"] = recorder.logprobs
        widths[str(width)] = {"recorded": recorded.summary() | candidate_stats(recorder.logprobs),
                              "synthetic": synthetic.summary(),
                              "prompts": sources[i * config.num_traces: (i + 1) * config.num_traces]}
        logger.info("width %d: recorded %s, synthetic %s", width, recorded.summary(), synthetic.summary())
    out = REPO_ROOT / config.output
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out, **arrays)
    checkpoint = Path(config.model.checkpoint) if config.model.checkpoint else None
    summary = {"widths": widths, "num_traces": config.num_traces, "steps": config.max_tokens,
               "output": config.output, "output_sha256": sha256_of(out),
               "model_sha256": sha256_of(REPO_ROOT / checkpoint / "model.safetensors")
               if checkpoint is not None and (REPO_ROOT / checkpoint / "model.safetensors").is_file() else None,
               "load_average": os.getloadavg(), "provenance": provenance(config, seed=config.seed)}
    write_json(REPO_ROOT / config.summary, summary)
    for width, stats in widths.items():
        rec, syn = stats["recorded"], stats["synthetic"]
        print(f"width {width}: parents/step recorded {rec['mean_parents_per_step']:.2f} synthetic "
              f"{syn['mean_parents_per_step']:.2f}; one-parent steps recorded {rec['one_parent_step_fraction']:.2f} "
              f"synthetic {syn['one_parent_step_fraction']:.2f}")
    return summary


def main() -> None:
    """The command line: `python -m experiments.record_beams [--config ...]`."""
    logging.basicConfig(level=logging.INFO)
    common.main(__doc__.splitlines()[0], RecordBeamsConfig, run, "configs/record_beams.yaml")
