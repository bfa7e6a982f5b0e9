"""Structured outputs' per-step cost: the matchers' masks and advances on the host, the sampler with them.

    python -m experiments.bench.bench_grammar --config configs/bench_grammar.yaml

R rows (batch sizes 1, 8, 64 by default), each a sequence with its own llguidance matcher compiled
from one spec over the asset model's tokenizer, walk through their grammar: every step the rows'
allowed tokens are built as the scheduler builds them (`build_controls`: one bitmask per row, the
seam's host half), a token is drawn from each row's mask (a random model), and every matcher is
advanced past it (`accept`, the postprocessor's host half); a row whose output completes starts
over from a fresh copy. Beside them, the whole jitted sampler call on random logits with those
masks (host arrays, device masking, the draw), against the same rows without a grammar. The specs
and batch sizes run interleaved `rounds` times, `steps` steps each; reported per step: median wall
and mean CPU time. Saved to results/bench_grammar.json.
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
from jpaged.core.constraints import StructuredOutputsParams
from jpaged.core.sampling_controls import build_controls
from jpaged.core.sequence import SamplingParams, Sequence, SequenceGroup
from jpaged.core.step_plan import SampleRows
from jpaged.executors.sampling import sample
from jpaged.text.structured_output import compiler_for
from jpaged.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class BenchGrammarConfig:
    """The tokenizer, the batch sizes, the specs (StructuredOutputsParams fields) and the repetitions."""

    model: str = "assets/stdlib-lm"  # a local HF directory: its tokenizer.json
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    specs: dict[str, dict[str, Any]] = dataclasses.field(default_factory=lambda: {
        "regex": {"regex": "[a-z]{1,8}_[0-9]{2}"}, "json_object": {"json_object": True}})
    steps: int = 32  # timed steps per case per round
    rounds: int = 3
    seed: int = 0
    output: str = "results/bench_grammar.json"

    def __post_init__(self) -> None:
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch_sizes: must be a non-empty list of ints >= 1, got {self.batch_sizes}")
        if min(self.steps, self.rounds) < 1:
            raise ValueError(f"steps and rounds: must be >= 1, got steps={self.steps}, rounds={self.rounds}")
        if not self.specs:
            raise ValueError("specs: must name at least one StructuredOutputsParams")
        for name, fields in self.specs.items():
            try:  # a bad spec names its field here, before any timing
                StructuredOutputsParams(**fields)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"specs.{name}: {exc}") from None


class _Case:
    """R rows of one spec: their sequences (with matchers), the same rows without, and random logits."""

    def __init__(self, spec: StructuredOutputsParams, rows: int, tokenizer: Tokenizer, rng: np.random.Generator):
        self.template = compiler_for(tokenizer).constraint(spec)
        self.rng = rng
        self.vocab = tokenizer.vocab_size
        self.seqs = [self._seq(r, SamplingParams(temperature=1.0, seed=r, max_tokens=10_000,
                                                 constraint=self.template)) for r in range(rows)]
        self.plain = [self._seq(r, SamplingParams(temperature=1.0, seed=r, max_tokens=10_000)) for r in range(rows)]
        self.logits = jax.device_put(rng.normal(size=(rows, self.vocab)).astype(np.float32) * 3)

    def _seq(self, r: int, params: SamplingParams) -> Sequence:
        seq = Sequence(r, self.rng.integers(5, self.vocab, 32).tolist())
        SequenceGroup(f"r{r}", [seq], params, 0.0, r, eos_token_ids=(2,))
        return seq

    def step(self) -> tuple[float, float, float, float]:
        """One step: (mask wall, mask CPU, accept wall, accept CPU) in seconds."""
        start, start_cpu = time.perf_counter(), time.process_time()
        controls = build_controls(self.seqs)
        mask_wall, mask_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        bits = np.unpackbits(controls.allowed_masks.view(np.uint8), axis=1, bitorder="little")  # [R, 32 W]
        tokens = [int(self.rng.choice(np.flatnonzero(row))) for row in bits]
        start, start_cpu = time.perf_counter(), time.process_time()
        for seq, token in zip(self.seqs, tokens):
            if not seq.constraint.accept(token):
                raise RuntimeError(f"token {token} was in the mask but the matcher refused it")
        accept_wall, accept_cpu = time.perf_counter() - start, time.process_time() - start_cpu
        for seq in self.seqs:
            if seq.constraint.is_terminated():  # complete: the row starts a new output
                seq.constraint = self.template.fork()
        return mask_wall, mask_cpu, accept_wall, accept_cpu

    def sampler_call(self, seqs: list[Sequence]) -> tuple[float, float]:
        """(wall, CPU) seconds of one jitted sampler call over `seqs`' rows, host arrays included."""
        rows = SampleRows(seqs=seqs, logits_rows=np.arange(len(seqs), dtype=np.int32), indices=None, num_top=0,
                          is_plain=True, first_token_groups=[])
        start, start_cpu = time.perf_counter(), time.process_time()
        jax.block_until_ready(sample(self.logits, rows.batch))
        return time.perf_counter() - start, time.process_time() - start_cpu


def run(config: BenchGrammarConfig) -> dict:
    """Times every spec at every batch size; returns and writes {"results": [...], ...}."""
    rng = np.random.default_rng(config.seed)
    tokenizer = Tokenizer.from_dir(REPO_ROOT / config.model)
    compiler = compiler_for(tokenizer)
    cases: dict[tuple[str, int], _Case] = {}
    compile_ms = {}
    for name, fields in config.specs.items():
        start = time.perf_counter()
        compiler.constraint(StructuredOutputsParams(**fields))
        compile_ms[name] = 1e3 * (time.perf_counter() - start)
        for rows in config.batch_sizes:
            case = cases[name, rows] = _Case(StructuredOutputsParams(**fields), rows, tokenizer, rng)
            case.sampler_call(case.seqs), case.sampler_call(case.plain)  # compiles both variants
    samples: dict[tuple[str, int], dict[str, list[float]]] = {key: {} for key in cases}
    for _ in tqdm(range(config.rounds), desc="rounds"):
        for key, case in cases.items():
            steps = [case.step() for _ in range(config.steps)]
            with_grammar = [case.sampler_call(case.seqs) for _ in range(config.steps)]
            without = [case.sampler_call(case.plain) for _ in range(config.steps)]
            for label, values in (("mask_wall", [s[0] for s in steps]), ("mask_cpu", [s[1] for s in steps]),
                                  ("accept_wall", [s[2] for s in steps]), ("accept_cpu", [s[3] for s in steps]),
                                  ("sampler_wall", [w for w, _ in with_grammar]),
                                  ("sampler_cpu", [c for _, c in with_grammar]),
                                  ("plain_sampler_wall", [w for w, _ in without]),
                                  ("plain_sampler_cpu", [c for _, c in without])):
                stat = statistics.median if label.endswith("wall") else statistics.fmean
                samples[key].setdefault(label, []).append(1e3 * stat(values))
    results = []
    for (name, rows), values in samples.items():
        row = {"spec": name, "rows": rows, "compile_ms": compile_ms[name]}
        row.update({f"{label}_ms": statistics.median(v) for label, v in values.items()})
        row["host_wall_ms_per_row"] = (row["mask_wall_ms"] + row["accept_wall_ms"]) / rows
        row["host_cpu_ms_per_row"] = (row["mask_cpu_ms"] + row["accept_cpu_ms"]) / rows
        results.append(row)
    print(f"{'spec':<12}{'R':>4}{'mask wall/cpu ms':>20}{'accept wall/cpu ms':>21}{'host cpu us/row':>17}"
          f"{'sampler wall ms: grammar / plain':>35}")
    for r in results:
        print(f"{r['spec']:<12}{r['rows']:>4}{r['mask_wall_ms']:11.3f} / {r['mask_cpu_ms']:6.3f}"
              f"{r['accept_wall_ms']:12.3f} / {r['accept_cpu_ms']:6.3f}{1e3 * r['host_cpu_ms_per_row']:17.1f}"
              f"{r['sampler_wall_ms']:23.2f} / {r['plain_sampler_wall_ms']:.2f}")
    result = {"results": results, "load_average": os.getloadavg(), "provenance": provenance(config, seed=config.seed)}
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], BenchGrammarConfig, run, "configs/bench_grammar.yaml")
