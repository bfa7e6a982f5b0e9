"""Output tok/s through the HTTP server vs the offline `LLM.generate`, same model, same workload.

    python -m experiments.bench.serve_vs_offline --config configs/serve_vs_offline.yaml

The workload is `jpaged bench-serving`'s (a ShareGPT-shaped trace, lengths scaled to the asset
model's 512 positions, prompts as token ids, temperature 0, `ignore_eos`, so both sides generate
exactly the same tokens). Offline: `LLM(model, **engine).generate(prompts)` in this process.
Server: `jpaged serve` with the same engine arguments in a child process, driven by
`jpaged bench-serving` in another (streamed /v1/completions, every request sent at once with
`request_rate: .inf`), one server per `stream_intervals` value (1 = every token, the default). Runs
interleave (each repeat rotates who goes first) after one warm-up run of each (which compiles
every shape); each repeat's ratio is server / offline output tok/s.
Printed and saved: tok/s, wall and CPU seconds of each run (offline: this process; server: its
process tree; client: bench-serving's own), the load average around each run, the ratios.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import statistics
import sys
import time
from typing import Any

from experiments.bench.serve_common import bench_serving, free_port, serving
from experiments.common import REPO_ROOT, main, provenance, write_json
from jpaged.core.sequence import SamplingParams
from jpaged.entrypoints.bench_serving import make_requests
from jpaged.entrypoints.llm import LLM

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ServeVsOfflineConfig:
    """The model, its engine arguments, and the workload."""

    model: str = "assets/stdlib-lm"
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # engine arguments (jpaged.entrypoints.engine_args)
    dataset: str = "sharegpt"
    num_prompts: int = 200
    length_scale: float = 0.25
    request_rate: float = math.inf
    stream_intervals: tuple[int, ...] = (1,)  # one server per value (vLLM's --stream-interval; 1 = default)
    repeats: int = 6
    seed: int = 0
    output: str = "results/serve_vs_offline.json"

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.num_prompts < 1:
            raise ValueError("repeats and num_prompts must be >= 1")


def serve_flags(engine: dict[str, Any]) -> list[str]:
    """`jpaged serve` flags for engine arguments."""
    flags = []
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


def bench_args(config) -> list[str]:
    """`jpaged bench-serving` flags of the workload."""
    return ["--dataset", config.dataset, "--num-prompts", str(config.num_prompts), "--request-rate",
            str(config.request_rate), "--length-scale", str(config.length_scale), "--seed", str(config.seed),
            "--tokenizer", config.model]


def run_offline(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """One timed LLM.generate of the workload."""
    cpu, start = time.process_time(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"output_tokens": tokens, "wall_s": wall, "cpu_s": time.process_time() - cpu,
            "output_tok_s": tokens / wall, "load_average": os.getloadavg()}


def run_server(server, config) -> dict:
    """One `jpaged bench-serving` run of the workload against the server."""
    report = bench_serving(server, bench_args(config))
    summary = report["summary"]
    return {"output_tokens": summary["total_output_tokens"], "wall_s": summary["duration_s"],
            "cpu_s": report["server_cpu_s"], "client_cpu_s": report["provenance"]["client_cpu_s"],
            "output_tok_s": summary["output_throughput"], "failed": summary["failed"],
            "mean_ttft_ms": summary["mean_ttft_ms"], "mean_tpot_ms": summary["mean_tpot_ms"],
            "load_average": report["load_average"]}


def run(config: ServeVsOfflineConfig) -> dict:
    """Interleaved offline and server runs; returns and writes their numbers and ratios."""
    llm = LLM(config.model, **config.engine)
    max_model_len = llm.engine.config.scheduler.max_model_len
    _, requests = make_requests(config.dataset, config.num_prompts, config.request_rate, config.seed,
                                llm.get_tokenizer().vocab_size, max_model_len, config.length_scale)
    prompts = [r.prompt_token_ids.tolist() for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
    sides = ["offline"] + [f"server_si{k}" for k in config.stream_intervals]
    runs: list[dict] = []
    with contextlib.ExitStack() as stack:
        servers = {}
        for k in config.stream_intervals:
            port = free_port()
            command = [sys.executable, "-m", "jpaged.entrypoints.cli", "serve", "--model", config.model, "--port", str(port),
                       "--stream-interval", str(k), "--disable-access-log", "--log-level", "warning",
                       *serve_flags(config.engine)]
            servers[f"server_si{k}"] = stack.enter_context(serving(f"jpaged-si{k}", command, port))

        def one(side: str) -> dict:
            return run_offline(llm, prompts, params) if side == "offline" else run_server(servers[side], config)

        for side in sides:
            one(side)  # warm-up: compiles every shape the workload needs
        for repeat in range(config.repeats):
            order = sides[repeat % len(sides):] + sides[: repeat % len(sides)]  # rotate who goes first
            for side in order:
                result = one(side)
                runs.append({"repeat": repeat, "side": side, **result})
                log.info("%s repeat %d: %.0f tok/s (wall %.2f s, cpu %.2f s, load %.1f)", side, repeat,
                         result["output_tok_s"], result["wall_s"], result["cpu_s"], result["load_average"][0])

    def median(side: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["side"] == side)

    summary: dict[str, Any] = {"output_tokens": runs[0]["output_tokens"],
                               "offline_tok_s_median": median("offline", "output_tok_s"),
                               "offline_cpu_s_median": median("offline", "cpu_s")}
    for side in sides[1:]:
        ratios = []
        for repeat in range(config.repeats):
            pair = {r["side"]: r for r in runs if r["repeat"] == repeat}
            if pair[side]["output_tokens"] != pair["offline"]["output_tokens"]:
                raise RuntimeError(f"{side} generated {pair[side]['output_tokens']} tokens, offline "
                                   f"{pair['offline']['output_tokens']}: not the same workload")
            ratios.append(pair[side]["output_tok_s"] / pair["offline"]["output_tok_s"])
        summary[side] = {"ratio_over_offline_median": statistics.median(ratios), "ratio_min": min(ratios),
                         "ratio_max": max(ratios), "ratios": ratios,
                         "tok_s_median": median(side, "output_tok_s"), "server_cpu_s_median": median(side, "cpu_s"),
                         "client_cpu_s_median": median(side, "client_cpu_s"),
                         "mean_tpot_ms_median": median(side, "mean_tpot_ms")}
    summary["target"] = "server within 10% of offline (ratio >= 0.9)"
    result = {"summary": summary, "runs": runs, "provenance": provenance(config, seed=config.seed)}
    for key, value in summary.items():
        if isinstance(value, dict):
            print(key + ": " + ", ".join(f"{k} {v:.3f}" for k, v in value.items() if isinstance(v, float)))
        else:
            print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    write_json(REPO_ROOT / config.output, result)
    return result


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main(__doc__.splitlines()[0], ServeVsOfflineConfig, run, "configs/serve_vs_offline.yaml")
