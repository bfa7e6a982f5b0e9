"""One timed run of vLLM's CPU build on a workload file: the peer side of experiments/peers/cpu_vs_vllm.py.

Runs in vLLM's own virtual environment (it imports only the standard library and vllm, never
jpaged), in a fresh process per run:

    <vllm-venv>/bin/python experiments/peers/cpu_peer_vllm.py WORKLOAD.json RESULT.json

WORKLOAD.json (written by cpu_vs_vllm.py): model_dir, dtype, prompts (token ids), output_lens,
kv_slots, block_size, max_num_seqs, max_model_len, max_num_batched_tokens, seed, num_logprobs. The
workload is served through `vllm.LLM.generate` twice alike (the first run warms up and compiles;
the second is timed), then, if num_logprobs > 0, once more untimed asking for the top
num_logprobs log-probabilities of every output token. RESULT.json: the greedy tokens of every
request, wall seconds and CPU seconds of the timed run, CPU time summed over this process and all
its descendants (vLLM's engine core runs in a child process); with num_logprobs, the last run's
tokens and log-probabilities (per request, per token, [token id, logprob] pairs).
"""

from __future__ import annotations

import json
import os
import sys
import time

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CLOCK_TICK_S = 1 / _CLOCK_TICKS  # the resolution of tree_cpu_seconds: /proc counts whole ticks


def tree_cpu_seconds(root: int | None = None) -> float:
    """User + system CPU seconds of process `root` (default: this one) and its live descendants,
    read from /proc (children that already exited are not counted: measure around a region in
    which none exit)."""
    root = os.getpid() if root is None else root
    children: dict[int, list[int]] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"; comm may hold spaces
        except OSError:  # the process exited while we looked
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)  # fields[1]: ppid
        times[pid] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime
    total, stack = 0.0, [root]
    while stack:
        pid = stack.pop()
        total += times.get(pid, 0.0)
        stack.extend(children.get(pid, []))
    return total


def llm_args(workload: dict) -> dict:
    """`vllm.LLM`'s arguments for a workload file's model and engine settings (model_dir, dtype,
    block_size, kv_slots, max_num_seqs, max_model_len, seed; max_num_batched_tokens where given):
    token-id prompts, exactly kv_slots of KV cache, prefix caching off."""
    # A fixed KV budget (GiB): by default vLLM sizes it from the memory free at start, and its
    # start failed at times on this shared machine. num_gpu_blocks_override then sets the slots.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    block_size = workload["block_size"]
    if workload["kv_slots"] % block_size:
        raise ValueError(f"kv_slots ({workload['kv_slots']}) must be a multiple of block_size ({block_size})")
    optional = {k: workload[k] for k in ("max_num_batched_tokens",) if k in workload}
    return dict(model=workload["model_dir"], skip_tokenizer_init=True, dtype=workload["dtype"], block_size=block_size,
                num_gpu_blocks_override=workload["kv_slots"] // block_size, max_num_seqs=workload["max_num_seqs"],
                max_model_len=workload["max_model_len"], enable_prefix_caching=False, seed=workload["seed"], **optional)


def run(workload: dict) -> dict:
    """Serves `workload` twice with vllm.LLM; returns the second run's tokens and times."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**llm_args(workload))
    prompts = [TokensPrompt(prompt_token_ids=p) for p in workload["prompts"]]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
              for n in workload["output_lens"]]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: compiles and fills caches
    start_wall, start_cpu = time.perf_counter(), tree_cpu_seconds()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start_wall, tree_cpu_seconds() - start_cpu
    import vllm

    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], "wall_s": wall, "cpu_s": cpu,
              "engine": f"vllm {vllm.__version__}"}
    if workload["num_logprobs"]:
        with_logprobs = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False,
                                        logprobs=workload["num_logprobs"]) for n in workload["output_lens"]]
        checked = llm.generate(prompts, with_logprobs, use_tqdm=False)
        result["check_tokens"] = [list(o.outputs[0].token_ids) for o in checked]
        result["check_logprobs"] = [[[[t, lp.logprob] for t, lp in position.items()] for position in o.outputs[0].logprobs]
                                    for o in checked]
    return result


def workload_main(run_workload) -> None:
    """A peer script's command line, `WORKLOAD.json RESULT.json`: `run_workload` of the first's
    JSON, written to the second."""
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} WORKLOAD.json RESULT.json")
    with open(sys.argv[1]) as f:
        result = run_workload(json.load(f))
    with open(sys.argv[2], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    workload_main(run)
