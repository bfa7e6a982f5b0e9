"""How long `jpaged serve` takes to be ready: from an empty cache folder, from the filled folder,
and from a copy of it at another path (issue 38's start-up targets: <= 60 s cold, <= 10 s filled,
also after the folder moves).

Each start is a fresh server process with `JPAGED_CACHE_DIR` set to the folder; ready is the first
200 from GET /health (the port answers 503 while the grid compiles), CPU the server's user + system
seconds at that moment, and the programs the number its warm-up log line reports. Linux only (CPU
time from /proc).

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
import tempfile
import time
from pathlib import Path

from experiments.bench.serve_common import ServerProcess, free_port
from experiments.common import cpu_description, git_sha, write_json

MODEL = "assets/stdlib-lm"
SETTINGS = {
    "defaults": [],  # the README's `jpaged serve --model assets/stdlib-lm`
    "benchmark": ["--dtype", "float32", "--block-size", "32", "--num-blocks", "4097", "--max-model-len", "512",
                  "--max-num-seqs", "256", "--max-num-batched-tokens", "2048"],  # the vllm bench serve runs'
}
_GRID_LINE = re.compile(r"compiled (\d+) programs in ([\d.]+) s \(([\d.]+) s CPU")


def start(flags: list[str], cache: Path) -> dict:
    """One server start with JPAGED_CACHE_DIR=`cache`: ready seconds, CPU seconds, the grid's log."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        raise SystemExit("unset JAX_COMPILATION_CACHE_DIR: the server would keep JAX's cache there")
    port = free_port()
    load_before = os.getloadavg()
    began = time.perf_counter()
    server = ServerProcess("jpaged-startup", ["python", "-m", "jpaged.entrypoints.cli", "serve", "--model", MODEL,
                                              "--port", str(port), *flags], port,
                           env={"JPAGED_CACHE_DIR": str(cache)})
    ready = time.perf_counter() - began
    cpu = server.cpu_seconds()
    server.stop()
    log = server.log.read_text()
    grid = _GRID_LINE.search(log)
    if grid is None:
        raise RuntimeError(f"no warm-up line in the server's log {server.log}")
    return {"ready_s": round(ready, 2), "cpu_s": round(cpu, 2), "programs": int(grid[1]),
            "grid_s": float(grid[2]), "grid_cpu_s": float(grid[3]), "load_before": load_before,
            "load_after": os.getloadavg()}


def run(settings: list[str]) -> dict:
    """Cold, filled and moved starts for each of `settings` (names of SETTINGS)."""
    results = {}
    for name in settings:
        with tempfile.TemporaryDirectory(prefix="jpaged-startup-") as tmp:
            first, moved = Path(tmp) / "cache", Path(tmp) / "elsewhere" / "cache"
            cold = start(SETTINGS[name], first)
            filled = start(SETTINGS[name], first)
            shutil.copytree(first, moved)
            shutil.rmtree(first)
            results[name] = {"flags": SETTINGS[name], "cold": cold, "filled": filled,
                             "moved": start(SETTINGS[name], moved)}
        print(name, {k: (v["ready_s"], v["cpu_s"], v["programs"]) for k, v in results[name].items() if k != "flags"})
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
    write_json(args.output, {"what": "jpaged serve --model assets/stdlib-lm: seconds to /health 200 and CPU "
                                     "seconds then, from an empty JPAGED_CACHE_DIR (cold), the same folder "
                                     "again (filled) and a copy of it at another path (moved)",
                             "command": "python -m experiments.bench.startup " + " ".join(
                                 ["--settings", *args.settings]),
                             "provenance": info, "starts": run(args.settings)})


if __name__ == "__main__":
    main()
