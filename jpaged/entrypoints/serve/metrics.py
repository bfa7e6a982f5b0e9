"""Prometheus metrics of a served engine under vLLM v1's names, fed by an EngineObserver.

The observer runs on the engine's thread after each step (prometheus_client's metrics are
thread-safe; /metrics reads them from the event loop). Names, meanings and histogram buckets are
vLLM v1's (vllm/v1/metrics/loggers.py and buckets.py), labelled `model_name` and `engine` ("0"):

- gauges `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
  (device KV blocks in use, 0-1); jpaged also swaps, which v1 does not: `vllm:num_requests_swapped`
  and `vllm:cpu_cache_usage_perc` (host swap blocks) keep vLLM v0's names;
- counters `vllm:prefix_cache_queries` and `vllm:prefix_cache_hits`, in tokens, as vLLM counts
  them: a new request queries its whole prompt when admitted and hits what the prefix cache served
  (a recomputed request's re-admission is not counted, as vLLM counts it apart; both stay 0 without
  prefix caching); `vllm:num_preemptions` (preempted requests), `vllm:prompt_tokens` (a request's
  prompt, counted at its first token), `vllm:generation_tokens` (every sampled token),
  `vllm:request_success{finished_reason}` (stop, length, abort, error);
- histograms `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds` (per request,
  between the steps that gave it tokens), `vllm:request_time_per_output_token_seconds` (per request:
  (finish - first token) / (output tokens - 1)), `vllm:e2e_request_latency_seconds`;
- jpaged's own, for what vLLM has no name for: `jpaged:prefix_cache_evictions` (device cached
  blocks evicted), `jpaged:pinned_prefix_blocks`, and the prefix cache's host tier (only with
  `--num-host-cache-blocks`): `jpaged:host_cache_usage_perc`, `jpaged:host_cache_promotions`
  (blocks brought back to the device by a match), `jpaged:host_cache_offloads`,
  `jpaged:host_cache_evictions` (docs/notes/host-tier.md); `jpaged:requests_shed`: generation
  requests refused with 503 because `--max-queued-requests` were waiting (serve/limits.py);
- with speculative decoding, vLLM v1's spec-decode counters: `vllm:spec_decode_num_drafts`
  (sequence-steps that verified drafts), `vllm:spec_decode_num_draft_tokens`,
  `vllm:spec_decode_num_accepted_tokens` and `vllm:spec_decode_num_accepted_tokens_per_pos`
  (labelled `position`, 0-based); a verify step counts the tokens it emits as generation tokens
  (each sequence's accepted drafts and its one sampled token), not its sample rows.
Times are the executor's clock (wall time for the real model), from the request's arrival.
"""

from __future__ import annotations

import logging

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from jpaged.core.kv.kv_manager import usage
from jpaged.core.outputs import RequestOutput
from jpaged.core.sched.scheduler import SchedulerOutput
from jpaged.core.sequence import SequenceGroup
from jpaged.core.step_plan import ModelOutput
from jpaged.engine import EngineObserver, LLMEngine

log = logging.getLogger(__name__)

# vLLM v1's buckets (seconds), vllm/v1/metrics/buckets.py.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
SPEC_LOG_INTERVAL_S = 10.0  # how often the spec-decode acceptance is logged (vLLM's stat logger interval)


class PrometheusObserver(EngineObserver):
    """Keeps the metrics of one engine in its own registry (several servers may share a process)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        prometheus_client.disable_created_metrics()  # no *_created samples (vLLM turns them off too)
        self.registry = registry or CollectorRegistry()
        names = ["model_name", "engine"]
        values = (model_name, "0")
        self._labels = names, values  # (the spec-decode counters are made at `attach`)

        def make(kind, name, doc, **kw):
            return kind(name, doc, labelnames=names, registry=self.registry, **kw).labels(*values)

        self.running = make(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = make(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.swapped = make(Gauge, "vllm:num_requests_swapped", "Number of requests swapped out to host memory.")
        self.kv_usage = make(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.cpu_cache = make(Gauge, "vllm:cpu_cache_usage_perc", "Host swap-space usage. 1 means 100 percent usage.")
        self.prefix_queries = make(Counter, "vllm:prefix_cache_queries",
                                   "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = make(Counter, "vllm:prefix_cache_hits",
                                "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = make(Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          labelnames=[*names, "finished_reason"], registry=self.registry)
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        self.ttft = make(Histogram, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         buckets=TTFT_BUCKETS)
        self.itl = make(Histogram, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        buckets=ITL_BUCKETS)
        self.tpot = make(Histogram, "vllm:request_time_per_output_token_seconds",
                         "Histogram of time_per_output_token_seconds per request.", buckets=ITL_BUCKETS)
        self.e2e = make(Histogram, "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        buckets=REQUEST_LATENCY_BUCKETS)
        self.cache_evictions = make(Counter, "jpaged:prefix_cache_evictions", "Device prefix-cache blocks evicted.")
        self.pinned = make(Gauge, "jpaged:pinned_prefix_blocks", "Blocks held by pre-stored (pinned) prefixes.")
        self.host_usage = make(Gauge, "jpaged:host_cache_usage_perc", "Host tier of the prefix cache: usage, 0-1.")
        self.host_counters = {key: make(Counter, f"jpaged:host_cache_{key}", f"Host tier of the prefix cache: {doc}.")
                              for key, doc in (("promotions", "blocks brought back to the device by a match"),
                                               ("offloads", "evicted device blocks copied to host"),
                                               ("evictions", "host blocks dropped"))}
        self.shed = make(Counter, "jpaged:requests_shed",
                         "Generation requests refused (503) because --max-queued-requests were waiting.")
        self._spec: dict[str, Counter] | None = None  # spec-decode counters (attach: when speculation is on)
        self._spec_per_pos: list[Counter] = []
        self._spec_counts: dict = {}  # the speculator's cumulative counts when last read
        self._spec_logged: tuple[float, dict] | None = None  # (clock, counts) at the last acceptance log
        self._cache_counts: dict[str, int] = {}  # the cache's cumulative counts when last read
        self._last_token: dict[str, float] = {}  # request id -> when its last token came (ITL)
        self._cached_tokens = 0  # the scheduler's prefix-hit count when last read

    def attach(self, engine: LLMEngine) -> None:
        """Starts observing `engine` (from now on: what it served before is not counted)."""
        self._cached_tokens = engine.scheduler.admission.num_cached_tokens
        if engine.scheduler.block_manager.prefix_cache is not None:
            stats = engine.prefix_cache_stats()
            self._cache_counts = {"evictions_device": stats["prefix_cache_evictions"],
                                  **{key: stats[f"host_cache_{key}"] for key in self.host_counters}}
        if engine.scheduler.speculator is not None:
            names, values = self._labels
            self._spec = {key: Counter(f"vllm:spec_decode_{key}", doc, labelnames=names,
                                       registry=self.registry).labels(*values)
                          for key, doc in (("num_drafts", "Number of spec decoding drafts."),
                                           ("num_draft_tokens", "Number of draft tokens."),
                                           ("num_accepted_tokens", "Number of accepted tokens."))}
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                              labelnames=[*names, "position"], registry=self.registry)
            self._spec_per_pos = [per_pos.labels(*values, str(i))
                                  for i in range(engine.config.speculative.num_speculative_tokens)]
            self._spec_counts = engine.spec_decode_stats()
            self._spec_logged = engine.executor.now(), self._spec_counts
        self._read_gauges(engine)  # the gauges hold from now on (pinned prefixes were stored before serving)
        engine.observers.append(self)

    def on_step_executed(self, engine: LLMEngine, out: SchedulerOutput, result: ModelOutput, start: float,
                         end: float) -> None:
        if out.plan.sampling is None or out.plan.sampling.spec_offsets is None:  # (a verify step's: on_step_end)
            self.generation_tokens.inc(len(result.token_ids))
        if out.num_preempted:
            self.preemptions.inc(out.num_preempted)
        self._count_prefix_cache(engine, out)
        rows = out.plan.sampling
        if rows is None:
            return
        first = {id(g) for g in rows.first_token_groups}
        for group in rows.first_token_groups:
            self.prompt_tokens.inc(group.prompt_len)
            self.ttft.observe(max(end - group.arrival_time, 0.0))
        for group in {id(s.group): s.group for s in rows.seqs}.values():  # one observation per request
            last = self._last_token.get(group.request_id)
            if last is not None and id(group) not in first:
                self.itl.observe(max(end - last, 0.0))
            self._last_token[group.request_id] = end

    def _count_prefix_cache(self, engine: LLMEngine, out: SchedulerOutput) -> None:
        """Prefix-cache queries and hits of the requests admitted for the first time this step."""
        cached = engine.scheduler.admission.num_cached_tokens
        hits, self._cached_tokens = cached - self._cached_tokens, cached
        if not engine.scheduler.prefix_caching or not out.admitted:
            return
        # The scheduler counts hits for the whole step; a step that also re-admits a recomputed
        # request (first scheduled earlier) cannot split them, so it is left out (rare: it needs
        # recompute preemption), rather than counting that request's own blocks as hits.
        if any(g.first_scheduled_time is not None for g in out.admitted):
            return
        self.prefix_queries.inc(sum(g.prompt_len for g in out.admitted))
        self.prefix_hits.inc(hits)

    def on_request_finished(self, engine: LLMEngine, group: SequenceGroup, output: RequestOutput) -> None:
        self._last_token.pop(group.request_id, None)
        reason = "error" if output.error else next((c.finish_reason for c in output.outputs if c.finish_reason),
                                                   "abort")
        self.success[reason if reason in self.success else "abort"].inc()
        if group.finish_time is None:
            return
        self.e2e.observe(max(group.finish_time - group.arrival_time, 0.0))
        num_output = max((s.num_output_tokens for s in group.seqs), default=0)
        if group.first_token_time is not None and num_output > 1:
            self.tpot.observe((group.finish_time - group.first_token_time) / (num_output - 1))

    def on_step_end(self, engine: LLMEngine, out: SchedulerOutput, outputs: list[RequestOutput], end: float) -> None:
        if self._spec is not None:
            self._count_spec_decode(engine, out)
            if end - self._spec_logged[0] >= SPEC_LOG_INTERVAL_S:
                self._log_spec_decode(end)
        self._read_gauges(engine)

    def _log_spec_decode(self, now: float) -> None:
        """Logs the acceptance of the drafts verified since the last log (vLLM's SpecDecoding line)."""
        then, before = self._spec_logged
        stats = self._spec_counts
        drafts = stats["spec_num_drafts"] - before["spec_num_drafts"]
        if drafts:
            drafted = stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
            accepted = stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
            per_pos = [(a - b) / drafts for a, b in zip(stats["spec_accepted_per_pos"], before["spec_accepted_per_pos"])]
            log.info("SpecDecoding metrics: mean acceptance length %.2f, accepted %d of %d drafted tokens "
                     "(%.1f%%), %d drafts in %.0f s, per-position acceptance rate %s", 1 + accepted / drafts,
                     accepted, drafted, 100 * accepted / max(drafted, 1), drafts, now - then,
                     ", ".join(f"{rate:.3f}" for rate in per_pos))
        self._spec_logged = now, stats

    def _count_spec_decode(self, engine: LLMEngine, out: SchedulerOutput) -> None:
        """The spec-decode counters advance by the speculator's counts since the last step; a
        verify step's generation tokens are its sequences' emitted ones."""
        stats, before = engine.spec_decode_stats(), self._spec_counts
        for key, counter in self._spec.items():
            counter.inc(stats[f"spec_{key}"] - before[f"spec_{key}"])
        for counter, now, then in zip(self._spec_per_pos, stats["spec_accepted_per_pos"],
                                      before["spec_accepted_per_pos"]):
            counter.inc(now - then)
        rows = out.plan.sampling
        if rows is not None and rows.spec_offsets is not None:
            accepted = stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
            self.generation_tokens.inc(rows.spec_offsets.count(0) + accepted)
        self._spec_counts = stats

    def _read_gauges(self, engine: LLMEngine) -> None:
        """The queues, KV usage and prefix-cache series as the engine stands now."""
        scheduler = engine.scheduler
        bm = scheduler.block_manager
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        self.swapped.set(len(scheduler.swapped))
        self.kv_usage.set(usage(bm))
        swap = bm.swap
        self.cpu_cache.set(1.0 - swap.num_free_blocks / swap.num_blocks if swap is not None and swap.num_blocks else 0.0)
        if bm.prefix_cache is not None:
            self._set_cache(engine)

    def _set_cache(self, engine: LLMEngine) -> None:
        """The prefix cache's evictions, pinned blocks and host tier (counters advance by the
        engine's cumulative counts since the last step)."""
        stats = engine.prefix_cache_stats()
        self.pinned.set(stats["num_pinned_blocks"])
        self.host_usage.set(stats["host_cache_usage"])
        counters = {"evictions_device": (self.cache_evictions, stats["prefix_cache_evictions"]),
                    **{key: (c, stats[f"host_cache_{key}"]) for key, c in self.host_counters.items()}}
        for key, (counter, total) in counters.items():
            if total > self._cache_counts.get(key, 0):
                counter.inc(total - self._cache_counts.get(key, 0))
            self._cache_counts[key] = total
