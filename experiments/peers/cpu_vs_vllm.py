"""jpaged vs vLLM's CPU build on this CPU: same local model, same requests, alternating fresh processes.

A random OPT-shaped model (jpaged's seeded dummy weights of preset `model.name`) is written once as
a local Hugging Face directory (config.json + model.safetensors, float32); both engines load it,
in each `dtypes` entry. The workload is serve_real's (ShareGPT-shaped lengths scaled down, all
requests at t=0, greedy, ignore_eos), served with equal KV slots (`kv_slots`; the smaller ones
force preemption, which both engines handle by recomputation). Each round runs jpaged, then
vLLM, each in a fresh process (A B A B ...) that serves the workload twice and times the second
run: wall seconds, and CPU seconds of the process and its children (vLLM's engine core is one).
Per condition the result gives output tokens per wall-second and per CPU-second of each engine,
the jpaged / vLLM ratios of each round, their medians, how many requests got identical greedy
tokens from both engines, and how many are "close" by vLLM's own test of two implementations of
one model (`tests/models/utils.py: check_logprobs_close`): the token sequences agree, or at their
first difference each engine's token is among the other's top `num_logprobs` candidates there.
In bfloat16 greedy sequences of two correct implementations part ways wherever the top two
logits lie within rounding of each other (Hugging Face's and vLLM's own bf16 OPT do too: see
docs/notes/cpu-vs-vllm.md), so bf16 is judged by closeness; float32 by identity. The
log-probabilities come from one more, untimed pass of each engine in the first round (asking for
them compiles other code in jpaged's sampler, so the warm-up and timed passes stay alike), and
that pass's tokens must equal the timed ones. jpaged runs attention_backend "auto": on CPU the
native attention kernel where it builds (pallas_kernels.native_cpu), else the XLA paths, and with it the
native dense kernel over packed weights (pallas_kernels.native_dense_cpu); each jpaged run
records both.

vLLM runs in its own virtual environment (../shared/bench/README.md), its interpreter given by
`vllm_python` or $JPAGED_VLLM_PYTHON (experiments.vllm_side); without one that imports
vllm, only jpaged's rounds are measured, and the output says so.

    python -m experiments.peers.cpu_vs_vllm --config configs/cpu_vs_vllm.yaml
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.bench.serve_real import ServeRealConfig, make_requests
from experiments.common import REPO_ROOT, main, provenance, write_json
from experiments.peers.cpu_peer_vllm import CLOCK_TICK_S, tree_cpu_seconds
from experiments.vllm_side import vllm_python, vllm_unavailable

logger = logging.getLogger(__name__)
ENGINES = ("jpaged", "vllm")
ATTEMPTS = 3  # fresh-process starts per run before giving up


@dataclasses.dataclass(frozen=True)
class CpuVsVllmConfig:
    """Model, workload, memory conditions and rounds of the comparison."""

    model: str = "opt-125m"  # an OPT preset (jpaged.config.presets): its shapes, jpaged's dummy weights
    seed: int = 0  # dummy weights and workload
    dtypes: list[str] = dataclasses.field(default_factory=lambda: ["float32"])
    kv_slots: list[int] = dataclasses.field(default_factory=lambda: [4096])  # KV tokens each engine gets
    num_requests: int = 64
    length_scale: float = 0.125  # serve_real's: ShareGPT lengths times this
    max_model_len: int = 256
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    jpaged_block_size: int = 16
    vllm_block_size: int = 32  # vLLM's CPU attention takes multiples of 32 only
    rounds: int = 2  # A B pairs per condition
    num_logprobs: int = 5  # top candidates per token in the first round's checking pass (closeness)
    vllm_python: str = ""  # interpreter of vLLM's own virtual environment ("": $JPAGED_VLLM_PYTHON)
    output: str = "results/cpu_vs_vllm.json"

    def __post_init__(self) -> None:
        if not self.dtypes or set(self.dtypes) - {"float32", "bfloat16"}:
            raise ValueError(f"dtypes must be a non-empty list of 'float32'/'bfloat16', got {self.dtypes}")
        for name in ("rounds", "num_requests", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
                     "num_logprobs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        block = np.lcm(self.jpaged_block_size, self.vllm_block_size)
        if not self.kv_slots or any(s < self.max_model_len or s % block for s in self.kv_slots):
            raise ValueError(f"kv_slots must be multiples of {block} (both block sizes) >= max_model_len "
                             f"({self.max_model_len}), got {self.kv_slots}")


def write_hf_dir(directory: Path, name: str, seed: int) -> Path:
    """jpaged's seeded dummy weights of OPT preset `name` as a float32 Hugging Face directory."""
    from safetensors.numpy import save_file

    from jpaged.config.presets import get_preset
    from jpaged.models import decoder
    from jpaged.models.hf_names import hf_tensor_names

    spec = get_preset(name)
    if spec.family != "opt":
        raise ValueError(f"model: an OPT preset is needed (vLLM and jpaged both load its HF layout), got {name!r}")
    params = decoder.init_params(spec, seed)
    tensors = {}
    for path, (names, transposed) in hf_tensor_names(spec).items():
        leaf = params
        for key in path:
            leaf = leaf[key]
        for hf_name, arr in zip(names, list(np.asarray(leaf)) if path[0] == "layers" else [np.asarray(leaf)]):
            tensors["model." + hf_name] = np.ascontiguousarray(arr.T if transposed else arr, np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    config = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "vocab_size": spec.vocab_size,
              "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
              "num_attention_heads": spec.num_heads, "ffn_dim": spec.intermediate_size,
              "max_position_embeddings": spec.max_position_embeddings, "word_embed_proj_dim": spec.hidden_size,
              "do_layer_norm_before": True, "activation_function": "relu", "enable_bias": True,
              "layer_norm_elementwise_affine": True, "tie_word_embeddings": True, "torch_dtype": "float32",
              "bos_token_id": 2, "eos_token_id": 2, "pad_token_id": 1, "dropout": 0.0}
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def run_jpaged(workload: dict) -> dict:
    """Serves `workload` twice alike with LLMEngine in this process (a warm-up that compiles, then
    the timed run), then, if `num_logprobs` > 0, once more untimed with the top `num_logprobs`
    log-probabilities of every token."""
    from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from jpaged.core.sequence import SamplingParams
    from jpaged.engine import LLMEngine
    from jpaged.executors.jax import JaxExecutor

    block_size = workload["block_size"]
    config = EngineConfig(
        # auto: on CPU the native decode kernel where it builds (pallas_kernels.native_cpu), else XLA.
        model=ModelConfig(name=workload["model"], dtype=workload["dtype"], attention_backend="auto",
                          checkpoint=workload["model_dir"]),
        cache=CacheConfig(block_size=block_size, num_blocks=workload["kv_slots"] // block_size + 1,
                          num_host_blocks=0),  # + the reserved block 0; no swap space: recompute
        scheduler=SchedulerConfig(max_num_seqs=workload["max_num_seqs"], max_model_len=workload["max_model_len"],
                                  max_num_batched_tokens=workload["max_num_batched_tokens"]))
    executor = JaxExecutor(config)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in workload["output_lens"]]
    LLMEngine(config, executor=executor).generate(workload["prompts"], params)  # warm-up: compiles
    engine = LLMEngine(config, executor=executor)
    start_wall, start_cpu = time.perf_counter(), tree_cpu_seconds()
    outputs = engine.generate(workload["prompts"], params)
    # (a region shorter than one clock tick reads 0 CPU seconds: count it as one, the resolution)
    wall, cpu = time.perf_counter() - start_wall, max(tree_cpu_seconds() - start_cpu, CLOCK_TICK_S)
    result = {"tokens": [list(o.output_token_ids[0]) for o in outputs], "wall_s": wall, "cpu_s": cpu,
              "engine": "jpaged", "attention_backend": executor.runner.backend,
              "native_dense": executor.runner.native_dense}
    if workload["num_logprobs"]:
        with_logprobs = [dataclasses.replace(p, logprobs=workload["num_logprobs"]) for p in params]
        checked = LLMEngine(config, executor=executor).generate(workload["prompts"], with_logprobs)
        result["check_tokens"] = [list(o.output_token_ids[0]) for o in checked]
        result["check_logprobs"] = [[list(position.items()) for position in o.outputs[0].logprobs] for o in checked]
    return result


def logprobs_close(tokens_a: list[int], logprobs_a: list, tokens_b: list[int], logprobs_b: list) -> bool:
    """vLLM's closeness test of two greedy outputs (`check_logprobs_close`): identical, or at the
    first position where they differ each token is among the other's candidates there (later
    positions are not compared: the contexts differ from then on). `logprobs_*`: per position,
    [token id, logprob] pairs of the top candidates."""
    for position, (a, b) in enumerate(zip(tokens_a, tokens_b)):
        if a != b:
            return (a in {t for t, _ in logprobs_b[position]}) and (b in {t for t, _ in logprobs_a[position]})
    return len(tokens_a) == len(tokens_b)


def _run_fresh(engine: str, workload: dict, python: str, tmp: Path) -> dict:
    """One engine's timed run in a fresh process; its result plus the load average before it."""
    spec_path, out_path = tmp / "workload.json", tmp / f"{engine}.json"
    spec_path.write_text(json.dumps(workload))
    out_path.unlink(missing_ok=True)
    if engine == "jpaged":
        command = [sys.executable, "-m", "experiments.peers.cpu_vs_vllm", "--jpaged-worker", str(spec_path),
                   str(out_path)]
    else:
        command = [python, str(REPO_ROOT / "experiments" / "peers" / "cpu_peer_vllm.py"), str(spec_path), str(out_path)]
    for attempt in range(1, ATTEMPTS + 1):
        load = os.getloadavg()
        done = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True)
        if done.returncode == 0:
            break
        # vLLM's engine start fails now and then on this shared machine: say so, try again.
        lines = done.stderr.splitlines()
        causes = [line for line in lines if "Error" in line or "rror:" in line][:10]  # from vLLM's children too
        print(f"{engine} run failed (exit {done.returncode}, attempt {attempt} of {ATTEMPTS}); its first errors:\n"
              + "\n".join(causes) + "\nthe end of its stderr:\n" + "\n".join(lines[-15:]), file=sys.stderr, flush=True)
        time.sleep(10)  # let the failed run's processes and shared memory go
    else:
        raise RuntimeError(f"{engine} run failed {ATTEMPTS} times (see stderr above)")
    result = json.loads(out_path.read_text())
    return {**result, "load_average_before": load, "load_average_after": os.getloadavg(), "attempts": attempt}


def _summary(runs: dict[str, list[dict]], output_tokens: int) -> dict:
    """Tokens per wall- and CPU-second of each engine (medians over rounds) and jpaged / vLLM ratios."""
    out: dict = {}
    for engine, engine_runs in runs.items():
        out[engine] = {"tok_per_wall_s": statistics.median(output_tokens / r["wall_s"] for r in engine_runs),
                       "tok_per_cpu_s": statistics.median(output_tokens / r["cpu_s"] for r in engine_runs)}
    if runs.get("vllm"):
        pairs = list(zip(runs["jpaged"], runs["vllm"]))
        out["ratio_wall_per_round"] = [v["wall_s"] / j["wall_s"] for j, v in pairs]  # > 1: jpaged faster
        out["ratio_cpu_per_round"] = [v["cpu_s"] / j["cpu_s"] for j, v in pairs]
        out["ratio_wall"] = statistics.median(out["ratio_wall_per_round"])
        out["ratio_cpu"] = statistics.median(out["ratio_cpu_per_round"])
        first_j, first_v = pairs[0]
        out["identical_requests"] = sum(a == b for a, b in zip(first_j["tokens"], first_v["tokens"]))
        out["close_requests"] = sum(logprobs_close(*args) for args in zip(
            first_j["check_tokens"], first_j["check_logprobs"], first_v["check_tokens"], first_v["check_logprobs"]))
    for engine, engine_runs in runs.items():  # every timed run gave the first's tokens, and so did the checking pass
        out[f"{engine}_deterministic"] = (all(r["tokens"] == engine_runs[0]["tokens"] for r in engine_runs)
                                          and engine_runs[0].get("check_tokens", engine_runs[0]["tokens"])
                                          == engine_runs[0]["tokens"])
    return out


def run(config: CpuVsVllmConfig) -> dict:
    """Every (dtype, kv_slots) condition, `rounds` A B pairs each; writes and returns the results."""
    python = vllm_python(config.vllm_python)
    skip = vllm_unavailable(python)
    if skip:
        print(f"vLLM side skipped: {skip}. Install vLLM's CPU build as ../shared/bench/README.md says; "
              f"measuring jpaged only.", flush=True)
    from jpaged.config.presets import get_preset

    serve = ServeRealConfig(num_requests=config.num_requests, length_scale=config.length_scale,
                            max_model_len=config.max_model_len, seed=config.seed)
    prompts, output_lens = make_requests(serve, get_preset(config.model).vocab_size)
    output_tokens = int(sum(output_lens))
    engines = ENGINES[:1] if skip else ENGINES
    conditions = []
    with tempfile.TemporaryDirectory(prefix="cpu_vs_vllm_") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = write_hf_dir(tmp / config.model, config.model, config.seed)
        for dtype in config.dtypes:
            for kv_slots in config.kv_slots:
                runs: dict[str, list[dict]] = {e: [] for e in engines}
                for round_index in range(config.rounds):
                    for engine in engines:  # A B, A B, ...: each in a fresh process
                        workload = {"model": config.model, "model_dir": str(model_dir), "dtype": dtype,
                                    "prompts": prompts, "output_lens": output_lens, "kv_slots": kv_slots,
                                    "block_size": config.jpaged_block_size if engine == "jpaged"
                                    else config.vllm_block_size, "max_num_seqs": config.max_num_seqs,
                                    "max_model_len": config.max_model_len, "seed": config.seed,
                                    "max_num_batched_tokens": config.max_num_batched_tokens,
                                    "num_logprobs": config.num_logprobs if round_index == 0 else 0}
                        result = _run_fresh(engine, workload, python, tmp)
                        runs[engine].append(result)
                        print(f"{dtype:<9} kv {kv_slots:<5} round {round_index} {engine:<6} "
                              f"{output_tokens / result['wall_s']:7.1f} tok/wall-s "
                              f"{output_tokens / result['cpu_s']:7.1f} tok/cpu-s  "
                              f"load {result['load_average_before'][0]:.2f}", flush=True)
                summary = _summary(runs, output_tokens)
                print(f"{dtype:<9} kv {kv_slots:<5} summary {json.dumps(summary)}", flush=True)
                request_0 = {e: runs[e][0]["tokens"][0][:16] for e in engines}  # a sample to eyeball
                for engine_runs in runs.values():
                    for r in engine_runs:
                        for key in ("tokens", "check_tokens", "check_logprobs"):
                            r.pop(key, None)
                conditions.append({"dtype": dtype, "kv_slots": kv_slots, "summary": summary, "runs": runs,
                                   "request_0_first_tokens": request_0})
                result = {"model": config.model, "output_tokens": output_tokens, "num_requests": config.num_requests,
                          "vllm_skipped": skip, "cpu_count": os.cpu_count(), "conditions": conditions,
                          "command": " ".join(["python -m experiments.peers.cpu_vs_vllm", *sys.argv[1:]]),
                          "provenance": provenance(config, seed=config.seed)}
                write_json(REPO_ROOT / config.output, result)  # after every condition: a failure keeps the rest
    return result


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--jpaged-worker":
        logging.basicConfig(level=logging.WARNING)
        Path(sys.argv[3]).write_text(json.dumps(run_jpaged(json.loads(Path(sys.argv[2]).read_text()))))
    else:
        logging.basicConfig(level=logging.INFO)
        main(__doc__.splitlines()[0], CpuVsVllmConfig, run, "configs/cpu_vs_vllm.yaml")
