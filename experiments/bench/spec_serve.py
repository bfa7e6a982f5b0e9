"""Speculative decoding served: `jpaged serve` with and without it, driven by `jpaged bench-serving`
or by vLLM's own `vllm bench serve`.

    python -m experiments.bench.spec_serve --config configs/spec_serve.yaml
    JPAGED_VLLM_PYTHON=... python -m experiments.bench.spec_serve --config configs/spec_serve_vllm_client.yaml

Two servers of the same model and engine arguments, one with the config's `--speculative-config`,
serve the same workload at each request rate of the config, interleaved, each repeat rotating
which goes first: `client: jpaged` runs `jpaged bench-serving` (vLLM benchmark_serving's client
and metrics, the config's dataset); `client: vllm` runs `vllm bench serve` from vLLM's
environment (`vllm_python` or $JPAGED_VLLM_PYTHON, experiments.vllm_side) on its random dataset
(`random_input_len` / `random_output_len`, `ignore_eos`, the config's `temperature`). At a low
rate few requests run at once, where speculation pays on this CPU; at rate inf every request
arrives at once and the threshold (`disable_by_batch_size`) turns it off. Per run: output tok/s,
mean and median TPOT and TTFT, the server's CPU seconds, the load, and the speculative server's
`vllm:spec_decode_*` counters read from /metrics. Per rate: medians and the per-repeat ratios
(with over without). Saved to results/spec_serve.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import statistics
import sys
import urllib.request
from typing import Any

from experiments.bench.serve_common import bench_serving, free_port, serving
from experiments.bench.serve_vs_offline import serve_flags
from experiments.common import REPO_ROOT, main, provenance, write_json
from experiments.vllm_side import random_dataset_args, vllm_bench_serve, vllm_python, vllm_unavailable

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SpecServeConfig:
    """The model, its engine arguments, the speculative config and the served workload."""

    model: str = "assets/stdlib-lm"
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # `jpaged serve` flags by engine argument
    speculative: dict[str, Any] = dataclasses.field(default_factory=lambda: {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "disable_by_batch_size": 4})
    dataset: str = "sharegpt"
    num_prompts: int = 40
    length_scale: float = 0.25
    request_rates: tuple[float, ...] = (1.0, float("inf"))
    repeats: int = 3
    seed: int = 0
    client: str = "jpaged"  # jpaged (jpaged bench-serving) | vllm (vllm bench serve)
    vllm_python: str = ""  # client vllm: vLLM's interpreter ("": $JPAGED_VLLM_PYTHON)
    random_input_len: int = 128  # client vllm: its random dataset's lengths
    random_output_len: int = 128
    temperature: float | None = None  # client vllm: None leaves the client's default (1.0)
    output: str = "results/spec_serve.json"

    def __post_init__(self) -> None:
        if min(self.repeats, self.num_prompts) < 1 or not self.request_rates:
            raise ValueError("repeats and num_prompts must be >= 1, request_rates non-empty")
        if self.client not in ("jpaged", "vllm"):
            raise ValueError(f"client: must be 'jpaged' or 'vllm', got {self.client!r}")


def spec_counters(base_url: str) -> dict[str, float]:
    """The server's `vllm:spec_decode_*` counters (totals over their labels) from /metrics."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:spec_decode_") and "_total" in line.split("{")[0]:
            name = line.split("{")[0].removesuffix("_total")
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def one_run(server, config: SpecServeConfig, rate: float, python: str = "") -> dict:
    """One client run at `rate` (`python`: vLLM's, for `client: vllm`), with the spec-decode
    counters it moved."""
    before = spec_counters(server.base_url)
    if config.client == "vllm":
        args = random_dataset_args(config.model, input_len=config.random_input_len,
                                   output_len=config.random_output_len, num_prompts=config.num_prompts, rate=rate,
                                   seed=config.seed, temperature=config.temperature)
        s = vllm_bench_serve(server, python, args)
        report = {"server_cpu_s": s["server_cpu_s"], "load_average": s["load_average"]}
    else:
        report = bench_serving(server, ["--dataset", config.dataset, "--num-prompts", str(config.num_prompts),
                                        "--request-rate", str(rate), "--length-scale", str(config.length_scale),
                                        "--seed", str(config.seed), "--tokenizer", config.model])
        s = report["summary"]
    after = spec_counters(server.base_url)
    drafts = after.get("vllm:spec_decode_num_drafts", 0) - before.get("vllm:spec_decode_num_drafts", 0)
    accepted = (after.get("vllm:spec_decode_num_accepted_tokens", 0)
                - before.get("vllm:spec_decode_num_accepted_tokens", 0))
    return {"output_tok_s": s["output_throughput"], "mean_tpot_ms": s["mean_tpot_ms"],
            "median_tpot_ms": s["median_tpot_ms"], "mean_ttft_ms": s["mean_ttft_ms"], "failed": s["failed"],
            "output_tokens": s["total_output_tokens"], "server_cpu_s": report["server_cpu_s"],
            "load_average": report["load_average"], "drafts": drafts,
            "acceptance_length": 1 + accepted / drafts if drafts else None}


def run(config: SpecServeConfig) -> dict:
    """Both servers, a warm-up run each, then interleaved runs per rate; returns and writes them."""
    python = vllm_python(config.vllm_python) if config.client == "vllm" else ""
    if config.client == "vllm" and (reason := vllm_unavailable(python)):
        raise ValueError(f"vllm_python: {reason}")
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for side, extra in (("off", []), ("spec", ["--speculative-config", json.dumps(config.speculative)])):
            port = free_port()
            command = [sys.executable, "-m", "jpaged.entrypoints.cli", "serve", "--model", config.model, "--port",
                       str(port), "--disable-access-log", "--log-level", "warning", *serve_flags(config.engine), *extra]
            servers[side] = stack.enter_context(serving(f"jpaged-{side}", command, port))
        for rate in config.request_rates:
            for side in servers:  # warm-up (the grid is compiled already; this fills the caches)
                one_run(servers[side], config, rate, python)
            for repeat in range(config.repeats):
                order = list(servers)[repeat % 2:] + list(servers)[: repeat % 2]
                for side in order:
                    result = one_run(servers[side], config, rate, python)
                    runs.append({"rate": rate, "repeat": repeat, "side": side, **result})
                    log.info("rate %s %s repeat %d: %.0f tok/s, median TPOT %.1f ms", rate, side, repeat,
                             result["output_tok_s"], result["median_tpot_ms"])
    summary = []
    for rate in config.request_rates:
        pairs = [({r["side"]: r for r in runs if r["rate"] == rate and r["repeat"] == i}) for i in range(config.repeats)]
        lengths = [p["spec"]["acceptance_length"] for p in pairs if p["spec"]["acceptance_length"] is not None]
        row = {"rate": rate,
               "off_tok_s_median": statistics.median(p["off"]["output_tok_s"] for p in pairs),
               "spec_tok_s_median": statistics.median(p["spec"]["output_tok_s"] for p in pairs),
               "tok_s_ratios": [p["spec"]["output_tok_s"] / p["off"]["output_tok_s"] for p in pairs],
               "off_median_tpot_ms": statistics.median(p["off"]["median_tpot_ms"] for p in pairs),
               "spec_median_tpot_ms": statistics.median(p["spec"]["median_tpot_ms"] for p in pairs),
               "tpot_ratios": [p["spec"]["median_tpot_ms"] / p["off"]["median_tpot_ms"] for p in pairs],
               "acceptance_length_median": statistics.median(lengths) if lengths else None}
        row["tok_s_ratio_median"] = statistics.median(row["tok_s_ratios"])
        row["tpot_ratio_median"] = statistics.median(row["tpot_ratios"])
        summary.append(row)
        print(f"rate {rate}: tok/s {row['off_tok_s_median']:.0f} -> {row['spec_tok_s_median']:.0f} "
              f"({row['tok_s_ratio_median']:.2f}x), median TPOT {row['off_median_tpot_ms']:.1f} -> "
              f"{row['spec_median_tpot_ms']:.1f} ms ({row['tpot_ratio_median']:.2f}x), acceptance length "
              f"{row['acceptance_length_median']}")
    result = {"summary": summary, "runs": runs, "provenance": provenance(config, seed=config.seed)}
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main(__doc__.splitlines()[0], SpecServeConfig, run, "configs/spec_serve.yaml")
