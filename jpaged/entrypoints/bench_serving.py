"""`jpaged bench-serving`: replay a Poisson trace against any OpenAI-compatible server, as vLLM's
benchmarks/benchmark_serving.py does, and report its metrics.

    jpaged bench-serving --base-url http://127.0.0.1:8000 --dataset sharegpt --request-rate 4 \\
        --num-prompts 200 --length-scale 0.25 --output bench.json

Requests are the project's traces (jpaged.paper.workloads: ShareGPT- or Alpaca-shaped lengths, Poisson
arrivals, seeded pseudo-random prompt token ids), lengths scaled by --length-scale and clipped to
the server's max_model_len. Each is a streamed POST /v1/completions with the prompt as token ids,
max_tokens = its output length, `ignore_eos` (vLLM's extension, so every server generates the same
number of tokens), temperature 0, and `stream_options.include_usage` (the server's own token count).
The client is aiohttp, as in vLLM's script (a third of httpx's CPU per streamed chunk here, which
matters when client and server share the machine). Metrics, with vLLM's names: request throughput,
output and total token throughput, TTFT, TPOT (excluding the first token), ITL (gaps between
streamed chunks, pooled) and E2EL — mean, median, std, p90, p99 in ms — from the client's clock. Results (with every request) are written as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import platform
import resource
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import numpy as np

from jpaged.paper.metrics import RequestRecord, summarize_requests, summarize_token_times
from jpaged.paper.workloads import lengths_trace, poisson_arrivals, sample_lengths
from jpaged.text.tokenizer import Tokenizer


@dataclasses.dataclass
class RequestResult:
    """What the client saw of one request (seconds since the benchmark started)."""

    request_id: int
    prompt_len: int
    expected_output_len: int
    sent: float = 0.0
    chunk_times: list[float] = dataclasses.field(default_factory=list)  # arrival of each chunk with text
    finished: float = 0.0
    output_len: int = 0  # completion tokens, from the server's usage
    error: str | None = None


def make_requests(dataset: str, num_prompts: int, request_rate: float, seed: int, vocab_size: int,
                  max_model_len: int, length_scale: float) -> tuple[np.ndarray, list]:
    """(arrival times, TraceRequests) of the trace: scaled lengths within max_model_len, seeded."""
    arrival_rng, length_rng, token_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    arrivals = poisson_arrivals(request_rate, arrival_rng, num_requests=num_prompts)
    prompt_lens, output_lens = sample_lengths(dataset, num_prompts, length_rng)
    prompt_lens = np.clip(np.rint(prompt_lens * length_scale), 1, max_model_len // 2).astype(np.int64)
    output_lens = np.clip(np.rint(output_lens * length_scale), 1, max_model_len - prompt_lens).astype(np.int64)
    return arrivals, lengths_trace(arrivals, prompt_lens, output_lens, token_rng, vocab_size)


async def _send(session: aiohttp.ClientSession, url: str, model: str, request, start: float) -> RequestResult:
    result = RequestResult(request.request_id, request.prompt_len, request.output_len)
    payload = {"model": model, "prompt": request.prompt_token_ids.tolist(), "max_tokens": request.output_len,
               "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    result.sent = time.perf_counter() - start
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:  # one line at a time; events are "data: ...\n\n"
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter() - start
                chunk = json.loads(raw[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                if chunk.get("usage"):
                    result.output_len = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", ())):
                    result.chunk_times.append(now)
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.finished = time.perf_counter() - start
    if result.error is None and (not result.chunk_times or result.output_len < 1):
        result.error = "no output"
    return result


async def benchmark(base_url: str, model: str, arrivals: np.ndarray,
                    requests: list) -> tuple[list[RequestResult], float]:
    """Sends every request at its arrival time; (results, seconds from the first send to the last answer)."""
    url = base_url.rstrip("/") + "/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap on concurrent connections
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()

        async def at(t: float, request) -> RequestResult:
            await asyncio.sleep(max(0.0, t - (time.perf_counter() - start)))
            return await _send(session, url, model, request, start)

        results = await asyncio.gather(*(at(float(t), r) for t, r in zip(arrivals, requests)))
        return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float) -> dict:
    """vLLM benchmark_serving's metrics over the successful requests (ms, tokens/s, requests/s)."""
    ok = [r for r in results if r.error is None]
    if not ok:
        raise RuntimeError(f"every request failed; first error: {results[0].error if results else 'no requests'}")
    records = [RequestRecord(r.request_id, r.sent, r.sent, r.chunk_times[0], r.finished, r.prompt_len, r.output_len)
               for r in ok]
    summary = summarize_requests(records, duration_s=duration)
    summary |= summarize_token_times({str(r.request_id): r.chunk_times for r in ok})
    summary["failed"] = len(results) - len(ok)
    return summary


def format_summary(summary: dict) -> str:
    """The result table, laid out as vLLM's benchmark prints it."""
    rows = [("Successful requests:", summary["completed"]), ("Failed requests:", summary["failed"]),
            ("Benchmark duration (s):", summary["duration_s"]),
            ("Total input tokens:", summary["total_input_tokens"]),
            ("Total generated tokens:", summary["total_output_tokens"]),
            ("Request throughput (req/s):", summary["request_throughput"]),
            ("Output token throughput (tok/s):", summary["output_throughput"]),
            ("Total Token throughput (tok/s):", summary["total_token_throughput"])]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40}{v:<10.2f}" if isinstance(v, float) else f"{k:<40}{v:<10}" for k, v in rows]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p99", "P99")):
            name = f"{label} {key.upper()} (ms):"
            lines.append(f"{name:<40}{summary[f'{stat}_{key}_ms']:<10.2f}")
    lines.append("=" * 50)
    return "\n".join(lines)


def _model_card(base_url: str) -> dict:
    with urllib.request.urlopen(base_url.rstrip("/") + "/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]


def run(args: argparse.Namespace) -> int:
    """The `bench-serving` command: 0 when every request succeeded, 1 otherwise."""
    card = _model_card(args.base_url)
    model = args.model or card["id"]
    max_model_len = args.max_model_len or card.get("max_model_len")
    if not max_model_len:
        print("bench-serving: the server's /v1/models gives no max_model_len: pass --max-model-len", file=sys.stderr)
        return 2
    tokenizer_dir = args.tokenizer or model
    if not (Path(tokenizer_dir) / "tokenizer.json").is_file():
        print(f"bench-serving: {tokenizer_dir} has no tokenizer.json (prompt ids need the vocabulary): "
              "pass --tokenizer DIR", file=sys.stderr)
        return 2
    vocab_size = Tokenizer.from_dir(tokenizer_dir).vocab_size
    arrivals, requests = make_requests(args.dataset, args.num_prompts, args.request_rate, args.seed, vocab_size,
                                       max_model_len, args.length_scale)
    load_before = os.getloadavg()
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    results, duration = asyncio.run(benchmark(args.base_url, model, arrivals, requests))
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    summary = summarize(results, duration)
    print(format_summary(summary))
    report = {
        "provenance": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "python": platform.python_version(), "host": platform.node(),
                       "load_average_before": load_before, "load_average_after": os.getloadavg(),
                       "client_cpu_s": (cpu_after.ru_utime + cpu_after.ru_stime)
                       - (cpu_before.ru_utime + cpu_before.ru_stime), "server_model": card},
        "settings": {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf") for k, v in vars(args).items()
                     if k != "func"},
        "summary": summary,
        "requests": [dataclasses.asdict(r) for r in results],
    }
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.output}")
    return 0 if summary["failed"] == 0 else 1
