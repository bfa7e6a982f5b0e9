"""Speculative decoding against the same engine without it, offline, through the real engine.

    python -m experiments.bench.spec_decode --config configs/spec_decode.yaml

Two workloads on the asset model: `code_edit`, where copying pays (each prompt holds a piece of a
held-out standard-library file and then its first lines again, so the answer repeats code the
prompt contains), and `random` (random token prompts, the workload of vLLM's random benchmark).
At each batch size B, a run serves `rounds` batches of B different prompts of the workload one
after another (`LLM.generate` per batch; greedy, `ignore_eos`, the same output length), or more
batches where `min_prompts` asks (a batch-1 run of 4 prompts measures those 4 prompts'
acceptance, not the workload's), on engines built alike but for the `speculative:` section:
without speculation and with each speculative config. One warm-up batch per engine and batch
size compiles its shapes; then the engines run interleaved, each repeat rotating which goes
first. Per run: output tokens, wall and CPU seconds (all threads of this process), the load
average, and for speculation the drafts, drafted and accepted tokens (acceptance length = 1 +
accepted / drafts). Per (workload, batch, config): the median over repeats of each run's output
tok/s over the plain engine's in the same repeat. Saved to results/spec_decode.json.

With `vllm: true` and vLLM's CPU build at hand (`vllm_python` or $JPAGED_VLLM_PYTHON,
experiments.vllm_side), vLLM then serves the same batches the same way, without and with the
same speculative configs (experiments/peers/spec_peer_vllm.py, in vLLM's environment; vLLM 0.32 has
no `disable_by_batch_size`, so that key is left out on its side): its own speedups and acceptance
lengths beside jpaged's, and whether its greedy tokens equal jpaged's. The two engines run one
after the other, not interleaved: compare each one's speedup, not their tok/s across phases.
Without vLLM the JSON says why (`vllm_skipped`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import subprocess
import tempfile
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from experiments.common import REPO_ROOT, main, provenance, write_json
from experiments.lm import corpus
from experiments.vllm_side import vllm_python, vllm_unavailable
from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints.llm import LLM

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SpecDecodeConfig:
    """The model, its engine arguments, the speculative configs, the workloads and the batches."""

    model: str = "assets/stdlib-lm"
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # engine arguments (jpaged.entrypoints.engine_args)
    # name -> speculative_config (vLLM's dict); each is compared with the engine without speculation
    speculative: dict[str, dict[str, Any]] = dataclasses.field(
        default_factory=lambda: {"ngram_k4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                                              "prompt_lookup_min": 2}})
    workloads: tuple[str, ...] = ("code_edit", "random")
    batch_sizes: tuple[int, ...] = (1, 8, 64)
    rounds: int = 4  # a timed run serves `rounds` batches of B different prompts, one after another
    min_prompts: int = 0  # ... or as many as serve at least this many prompts, if more
    code_tokens: int = 200  # code_edit: tokens of code in the prompt, then its first `repeat_tokens` again
    repeat_tokens: int = 16
    prompt_len: int = 128  # random: prompt tokens
    output_len: int = 128
    repeats: int = 3
    holdout_every: int = 20  # code_edit reads the files the asset model did not train on (configs/train_lm.yaml)
    seed: int = 0
    vllm: bool = False  # also run vLLM's CPU build on the same batches (skipped, and said, without one)
    vllm_python: str = ""  # vLLM's interpreter ("": $JPAGED_VLLM_PYTHON)
    output: str = "results/spec_decode.json"

    def __post_init__(self) -> None:
        if min(self.repeats, self.rounds, self.output_len, self.prompt_len, self.code_tokens, self.repeat_tokens,
               *self.batch_sizes) < 1:
            raise ValueError("repeats, rounds, output_len, prompt_len, code_tokens, repeat_tokens and batch_sizes "
                             "must be >= 1")
        if self.min_prompts < 0:
            raise ValueError(f"min_prompts: must be >= 0, got {self.min_prompts}")
        unknown = set(self.workloads) - {"code_edit", "random"}
        if unknown:
            raise ValueError(f"workloads: unknown {sorted(unknown)}; allowed: code_edit, random")

    def rounds_at(self, batch: int) -> int:
        """Batches of `batch` prompts a timed run serves: `rounds`, or more to reach `min_prompts`."""
        return max(self.rounds, -(-self.min_prompts // batch))


def code_edit_prompts(llm: LLM, config: SpecDecodeConfig, count: int) -> list[list[int]]:
    """`count` prompts of held-out stdlib code: `code_tokens` tokens of a file's text, a blank
    line, then the first `repeat_tokens` of them again (the answer continues the repeat)."""
    tokenizer = llm.get_tokenizer()
    _, held_out = corpus.split(corpus.corpus_files("*.py"), config.holdout_every)
    prompts = []
    for text in corpus.read_texts(held_out):
        ids = tokenizer.encode(text)
        for start in range(0, len(ids) - config.code_tokens, config.code_tokens):
            code = ids[start: start + config.code_tokens]
            prompts.append(code + tokenizer.encode("\n\n") + code[: config.repeat_tokens])
            if len(prompts) == count:
                return prompts
    raise ValueError(f"the held-out files give fewer than {count} prompts of {config.code_tokens} tokens")


def run_once(llm: LLM, batches: list[list[list[int]]], params: SamplingParams) -> dict:
    """One timed run: an LLM.generate of each batch of prompts in turn, with the speculator's
    counts over them and the generated token ids (`token_ids`, one list per prompt)."""
    load_before = os.getloadavg()
    before = llm.engine.spec_decode_stats()
    cpu, start = time.process_time(), time.perf_counter()
    outputs = [o for prompts in batches for o in llm.generate(prompts, params, use_tqdm=False)]
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {"output_tokens": tokens, "wall_s": wall, "cpu_s": cpu, "output_tok_s": tokens / wall,
              "load_average_before": load_before, "load_average_after": os.getloadavg(),
              "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}
    after = llm.engine.spec_decode_stats()
    if after:
        drafts = after["spec_num_drafts"] - before["spec_num_drafts"]
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        result.update(drafts=drafts, draft_tokens=after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"],
                      accepted_tokens=accepted, acceptance_length=1 + accepted / drafts if drafts else None)
    return result


def run(config: SpecDecodeConfig) -> dict:
    """Warm-ups, then interleaved timed runs of each engine at each (workload, batch); returns and
    writes the per-repeat ratios and their medians."""
    engines = {"off": LLM(config.model, warmup=False, **config.engine)}
    for name, spec in config.speculative.items():
        engines[name] = LLM(config.model, warmup=False, speculative_config=spec, **config.engine)
    most = max(b * config.rounds_at(b) for b in config.batch_sizes)
    rng = np.random.default_rng(config.seed)
    vocab = engines["off"].engine.vocab_size
    workloads = {"code_edit": lambda: code_edit_prompts(engines["off"], config, most),
                 "random": lambda: rng.integers(0, vocab, (most, config.prompt_len)).tolist()}
    params = SamplingParams(max_tokens=config.output_len, ignore_eos=True)
    names = list(engines)
    runs: list[dict] = []
    tokens: dict[str, list[list[int]]] = {}  # "workload/batch/engine" -> the first timed run's ids
    peer_points: list[dict] = []
    points = [(w, b) for w in config.workloads for b in config.batch_sizes]
    bar = tqdm(total=len(points) * len(names) * (config.repeats + 1), desc="runs")
    prompts_of = {w: workloads[w]() for w in config.workloads}
    for workload, batch in points:
        prompts = prompts_of[workload]
        batches = [prompts[i * batch: (i + 1) * batch] for i in range(config.rounds_at(batch))]
        peer_points.append({"workload": workload, "batch": batch, "batches": batches})
        for name in names:  # warm-up: each engine compiles this batch's shapes
            run_once(engines[name], batches[:1], params)
            bar.update()
        for repeat in range(config.repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:  # rotate who goes first
                result = run_once(engines[name], batches, params)
                ids = result.pop("token_ids")
                if repeat == 0:
                    tokens[f"{workload}/{batch}/{name}"] = ids
                runs.append({"workload": workload, "batch": batch, "repeat": repeat, "engine": name, **result})
                bar.update()
                bar.set_postfix(workload=workload, batch=batch, engine=name, tok_s=f"{result['output_tok_s']:.0f}")
    bar.close()
    summary = summarise(config, runs, names)
    result = {"summary": summary, "runs": runs, "provenance": provenance(config, seed=config.seed)}
    if config.vllm:
        result.update(vllm_side(config, engines["off"], peer_points, tokens))
    write_json(REPO_ROOT / config.output, result)
    return result


def vllm_side(config: SpecDecodeConfig, llm: LLM, points: list[dict], tokens: dict) -> dict:
    """vLLM's runs of the same `points` (experiments/peers/spec_peer_vllm.py), summarised as
    jpaged's are, with the share of prompts whose greedy tokens equal jpaged's (`tokens`, keyed
    "workload/batch/engine") per point and engine; or why vLLM did not run."""
    python = vllm_python(config.vllm_python)
    if reason := vllm_unavailable(python):
        print(f"vLLM side skipped: {reason}")
        return {"vllm_skipped": reason}
    engine = llm.engine.config
    speculative = {name: {k: v for k, v in spec.items() if k != "disable_by_batch_size"}
                   for name, spec in config.speculative.items()}
    workload = {"model_dir": str(REPO_ROOT / config.model), "dtype": config.engine.get("dtype", "float32"),
                "block_size": engine.cache.block_size, "kv_slots": (engine.cache.num_blocks - 1) * engine.cache.block_size,
                "max_num_seqs": engine.scheduler.max_num_seqs, "max_model_len": engine.scheduler.max_model_len,
                "seed": config.seed, "output_len": config.output_len, "repeats": config.repeats,
                "speculative": {name: {**spec, "model": str(REPO_ROOT / spec["model"])} if "model" in spec else spec
                                for name, spec in speculative.items()},
                "points": points}
    with tempfile.TemporaryDirectory(prefix="spec-vllm-") as tmp:
        spec_path, out_path = os.path.join(tmp, "workload.json"), os.path.join(tmp, "result.json")
        with open(spec_path, "w") as f:
            json.dump(workload, f)
        subprocess.run([python, str(REPO_ROOT / "experiments" / "peers" / "spec_peer_vllm.py"), spec_path, out_path],
                       check=True, cwd=REPO_ROOT)
        with open(out_path) as f:
            peer = json.load(f)
    for run in peer["runs"]:
        run["acceptance_length"] = 1 + run["accepted_tokens"] / run["drafts"] if run["drafts"] else None
    print(f"vLLM ({peer['engine']}), the same batches:")
    same = {}
    for key, ids in peer["tokens"].items():
        workload_name, batch, _ = key.split("/")
        ours = tokens[f"{workload_name}/{batch}/off"]
        same[key] = sum(a == b for a, b in zip(ids, ours)) / len(ours)
    return {"vllm": {"engine": peer["engine"], "speculative": speculative, "runs": peer["runs"],
                     "summary": summarise(config, peer["runs"], ["off", *speculative]),
                     "same_tokens_as_jpaged": same}}


def summarise(config: SpecDecodeConfig, runs: list[dict], names: list[str]) -> list[dict]:
    """Per (workload, batch, speculative config): median tok/s of both engines, the median of the
    per-repeat ratios (wall and CPU), and the acceptance length; printed as a table."""
    def of(workload, batch, repeat, name):
        return next(r for r in runs if (r["workload"], r["batch"], r["repeat"], r["engine"]) ==
                    (workload, batch, repeat, name))

    rows = []
    print(f"{'workload':<11}{'batch':>6}{'config':>12}{'off tok/s':>11}{'spec tok/s':>12}{'speedup':>9}"
          f"{'cpu ratio':>11}{'accept len':>12}")
    for workload in config.workloads:
        for batch in config.batch_sizes:
            for name in names[1:]:
                pairs = [(of(workload, batch, i, "off"), of(workload, batch, i, name)) for i in range(config.repeats)]
                lengths = [s["acceptance_length"] for _, s in pairs if s["acceptance_length"] is not None]
                row = {"workload": workload, "batch": batch, "speculative": name,
                       "off_tok_s_median": statistics.median(o["output_tok_s"] for o, _ in pairs),
                       "spec_tok_s_median": statistics.median(s["output_tok_s"] for _, s in pairs),
                       "speedup_median": statistics.median(s["output_tok_s"] / o["output_tok_s"] for o, s in pairs),
                       "speedups": [s["output_tok_s"] / o["output_tok_s"] for o, s in pairs],
                       # CPU per output token, off over speculative: > 1 when speculation saves CPU too
                       "cpu_ratio_median": statistics.median((o["cpu_s"] / o["output_tokens"]) /
                                                             (s["cpu_s"] / s["output_tokens"]) for o, s in pairs),
                       "acceptance_length_median": statistics.median(lengths) if lengths else None}
                rows.append(row)
                length = row["acceptance_length_median"]
                print(f"{workload:<11}{batch:>6}{name:>12}{row['off_tok_s_median']:11.0f}{row['spec_tok_s_median']:12.0f}"
                      f"{row['speedup_median']:9.2f}{row['cpu_ratio_median']:11.2f}"
                      f"{'-' if length is None else f'{length:.2f}':>12}")
    return rows


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], SpecDecodeConfig, run, "configs/spec_decode.yaml")
