"""One `vllm bench serve` run (vLLM's own benchmark client) against a running server.

The client runs in vLLM's environment (`$JPAGED_VLLM_PYTHON`, experiments.vllm_side) through
experiments/peers/vllm_cli.py. It saves its result JSON with `--save-result`; this module reads it
back with the server's CPU seconds during the run, the run's wall time and the load average, and
refuses a run with failed requests (the client itself exits 0 when every request failed).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

from experiments.common import REPO_ROOT

SHIM = REPO_ROOT / "experiments" / "peers" / "vllm_cli.py"

# The metrics every comparison reads, in vLLM's result names (ms; throughputs per second).
METRICS = ("completed", "failed", "duration", "total_output_tokens", "request_throughput", "output_throughput",
           "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
           "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms")


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
