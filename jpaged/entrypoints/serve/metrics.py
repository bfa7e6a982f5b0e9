"""Prometheus metrics of a served engine, under vLLM's names, fed by an EngineObserver.

The observer runs on the engine's thread after each step (prometheus_client's metrics are
thread-safe; /metrics reads them from the event loop). Names and labels as vLLM's (v0, the paper's
engine, which also has the swapped queue), every metric labelled `model_name`:

- gauges `vllm:num_requests_running | waiting | swapped`, `vllm:gpu_cache_usage_perc` (device
  KV blocks in use, 0-1; "gpu" is vLLM's name for the device pool), `vllm:cpu_cache_usage_perc`
  (host swap blocks), `vllm:gpu_prefix_cache_hit_rate` (prompt tokens served from the prefix
  cache / prompt tokens admitted);
- counters `vllm:num_preemptions_total`, `vllm:prompt_tokens_total` (a request's prompt, counted
  when its first token is sampled), `vllm:generation_tokens_total` (every sampled token),
  `vllm:request_success_total{finished_reason}` (every finished request: stop, length, abort);
- histograms `vllm:time_to_first_token_seconds`, `vllm:time_per_output_token_seconds` (per
  request: (finish - first token) / (output tokens - 1), vLLM v1's request-level TPOT),
  `vllm:e2e_request_latency_seconds`.
Times are the executor's clock (wall time for the real model), from the request's arrival.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jpaged.core.kv_manager import usage
from jpaged.core.outputs import RequestOutput
from jpaged.core.scheduler import SchedulerOutput
from jpaged.core.sequence import SequenceGroup
from jpaged.core.step_plan import ModelOutput
from jpaged.engine import EngineObserver, LLMEngine

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class PrometheusObserver(EngineObserver):
    """Keeps the metrics of one engine in its own registry (several servers may share a process)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        prometheus_client.disable_created_metrics()  # no *_created samples (vLLM turns them off too)
        self.registry = registry or CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}

        def gauge(name, doc):
            return Gauge(name, doc, **labels).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, **labels).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, buckets=buckets, **labels).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Number of requests running (holding device blocks).")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be admitted.")
        self.swapped = gauge("vllm:num_requests_swapped", "Number of requests swapped out to host memory.")
        self.gpu_cache = gauge("vllm:gpu_cache_usage_perc", "Device KV-cache usage. 1 means 100 percent usage.")
        self.cpu_cache = gauge("vllm:cpu_cache_usage_perc", "Host swap-space usage. 1 means 100 percent usage.")
        self.prefix_hit_rate = gauge("vllm:gpu_prefix_cache_hit_rate",
                                     "Prompt tokens served from the prefix cache / prompt tokens admitted.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter("vllm:request_success", "Count of finished requests by finish reason.",
                                labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.model_name = model_name
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (per request).", TPOT_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                             E2E_BUCKETS)

    def on_step_executed(self, engine: LLMEngine, out: SchedulerOutput, result: ModelOutput, start: float,
                         end: float) -> None:
        self.generation_tokens.inc(len(result.token_ids))
        if out.num_preempted:
            self.preemptions.inc(out.num_preempted)
        rows = out.plan.sampling
        if rows is not None:
            for group in rows.first_token_groups:
                self.prompt_tokens.inc(group.prompt_len)
                self.ttft.observe(max(end - group.arrival_time, 0.0))

    def on_request_finished(self, engine: LLMEngine, group: SequenceGroup, output: RequestOutput) -> None:
        reason = next((c.finish_reason for c in output.outputs if c.finish_reason), "abort")
        self._success.labels(self.model_name, reason).inc()
        if group.finish_time is None:
            return
        self.e2e.observe(max(group.finish_time - group.arrival_time, 0.0))
        num_output = max((s.num_output_tokens for s in group.seqs), default=0)
        if group.first_token_time is not None and num_output > 1:
            self.tpot.observe((group.finish_time - group.first_token_time) / (num_output - 1))

    def on_step_end(self, engine: LLMEngine, out: SchedulerOutput, outputs: list[RequestOutput], end: float) -> None:
        scheduler = engine.scheduler
        bm = scheduler.block_manager
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.swapped.set(len(scheduler.swapped))
        self.gpu_cache.set(usage(bm))
        swap = bm.swap
        self.cpu_cache.set(1.0 - swap.num_free_blocks / swap.num_blocks if swap is not None and swap.num_blocks else 0.0)
        admission = scheduler.admission
        self.prefix_hit_rate.set(admission.num_cached_tokens / max(admission.num_prompt_tokens, 1))
