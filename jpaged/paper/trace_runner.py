"""Drive an engine over a timed request trace and measure it (paper §6: Figs. 2, 12, 13).

Requests join when the engine's clock passes their arrival time; when the engine is idle the
clock jumps to the next arrival (simulator: `advance_to`; real executor: sleep). Outputs are as
long as the trace says (max_tokens = output length, EOS ignored). A meter subscribes to the
engine's step events, so every executed step is measured where it happens: its duration and
batch size, optionally the KV usage breakdown of the pool while the step runs (after scheduling,
before finished sequences are freed) and the time every request received each token.
Deterministic for a deterministic executor and trace.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable

from tqdm.auto import tqdm

from jpaged.core.kv.kv_manager import usage
from jpaged.core.sched.scheduler import SchedulerOutput
from jpaged.core.sequence import SamplingParams
from jpaged.core.step_plan import ModelOutput, StepPlan
from jpaged.engine import EngineObserver, LLMEngine
from jpaged.paper.kv_usage import total_slots, usage_breakdown
from jpaged.paper.metrics import BatchOccupancyAccumulator, KVUsageAccumulator, RequestRecord
from jpaged.paper.workloads import TraceRequest

logger = logging.getLogger(__name__)

# (clock at the step's start in s, the step's plan) after every executed step.
StepObserver = Callable[[float, StepPlan], None]


@dataclasses.dataclass
class TraceResult:
    """What one run of a trace measured."""

    records: list[RequestRecord]  # finished requests, in finishing order
    num_rejected: int  # requests the engine rejected (they can never fit)
    num_preemptions: int  # group preemptions (swap or recompute)
    avg_batched_requests: float  # time-weighted requests per step (Fig. 13; see batch_sizes)
    batch_sizes: dict[str, float | None]  # requests_per_step / requests_resident, whole run and steady state
    kv_usage: dict[str, float] | None  # time-averaged KV breakdown in percent, when tracked
    kv_usage_steady: dict[str, float] | None  # the same after the pool first filled (None: it never did)
    num_steps: int  # executed steps
    end_time_s: float  # the engine's clock when the last request finished (virtual under sim)
    wall_s: float  # wall-clock seconds the run took
    token_times: dict[str, list[float]] | None  # request id -> clock at each of its tokens, when tracked


class _TraceMeter(EngineObserver):
    """Measures each executed step: its batch, the KV breakdown, token times, a user observer."""

    def __init__(self, kv: KVUsageAccumulator | None, observer: StepObserver | None,
                 token_times: dict[str, list[float]] | None):
        self.batch = BatchOccupancyAccumulator()
        self.kv = kv
        self.observer = observer
        self.token_times = token_times

    def on_step_executed(self, engine: LLMEngine, out: SchedulerOutput, result: ModelOutput, start: float,
                         end: float) -> None:
        """Records the step that just ran (its blocks as it saw them)."""
        plan = out.plan
        scheduler = engine.scheduler
        in_step = len({id(s.group) for s in plan.seqs})
        self.batch.add(result.duration, in_step, len(scheduler.running), pool_full=out.kv_full)
        if self.kv is not None:
            self.kv.add(result.duration, *usage_breakdown(scheduler), pool_full=out.kv_full)
        if self.observer is not None:
            self.observer(start, plan)
        if self.token_times is not None and plan.sampling is not None:
            for group in {id(s.group): s.group for s in plan.sampling.seqs}.values():
                self.token_times.setdefault(group.request_id, []).append(end)


def run_trace(engine: LLMEngine, trace: list[TraceRequest], *, track_kv: bool = False,
              observer: StepObserver | None = None, track_token_times: bool = False,
              until: float = float("inf"), show_progress: bool = False,
              params_of: Callable[[TraceRequest], SamplingParams] | None = None) -> TraceResult:
    """Serves `trace` (sorted by arrival) on `engine` until every request has finished, or until
    the clock passes `until` seconds (requests unfinished then are left out of the records).

    `track_kv` averages the KV breakdown over the run's steps, weighted by their durations (it
    costs a pass over the block tables per step: only the memory-waste experiment needs it).
    `observer` sees every executed step. `track_token_times` records when each request received
    each of its tokens (inter-token latencies). `params_of` gives a request's sampling parameters
    (parallel sampling, beam search); by default one sequence of exactly output_len tokens.
    The engine should have no requests; the trace starts at its clock's current reading (0 for a
    fresh simulator; a reused real executor keeps its compiled steps), and every time reported
    is relative to that start.
    """
    executor = engine.executor
    kv = KVUsageAccumulator(total_slots(engine.scheduler)) if track_kv else None
    meter = _TraceMeter(kv, observer, {} if track_token_times else None)
    wait = getattr(executor, "advance_to", None) or (lambda t: time.sleep(max(0.0, t - executor.now())))
    lengths = {str(r.request_id): (r.request_id, r.prompt_len) for r in trace}
    records: list[RequestRecord] = []
    num_rejected = 0
    bar = tqdm(total=len(trace), desc="trace", mininterval=1.0, disable=not show_progress)
    engine.observers.append(meter)
    start = time.perf_counter()
    t0 = executor.now()  # the trace's time 0 on the executor's clock
    try:
        i, n = 0, len(trace)
        while (i < n or engine.has_unfinished()) and executor.now() - t0 < until:
            now = executor.now()
            while i < n and trace[i].arrival_time + t0 <= now:
                req = trace[i]
                params = (SamplingParams(max_tokens=req.output_len, ignore_eos=True) if params_of is None
                          else params_of(req))
                engine.add_request(str(req.request_id), req.prompt_token_ids.tolist(), params,
                                   arrival_time=req.arrival_time + t0)
                i += 1
            steps = engine.num_steps
            outputs = [o for o in engine.step() if o.finished] if engine.has_unfinished() else []
            for out in outputs:
                if out.error is not None:
                    num_rejected += 1
                    continue
                request_id, prompt_len = lengths[out.request_id]
                if out.first_scheduled_time < out.arrival_time:
                    raise RuntimeError(f"request {out.request_id} was scheduled before it arrived")
                records.append(RequestRecord(request_id, out.arrival_time - t0, out.first_scheduled_time - t0,
                                             out.first_token_time - t0, out.finish_time - t0, prompt_len,
                                             len(out.output_token_ids[0])))
            bar.update(len(outputs))
            if engine.num_steps == steps and not outputs:  # nothing ran: idle until the next arrival
                if i == n:
                    raise RuntimeError(f"the engine made no progress with {n - len(records) - num_rejected} "
                                       "requests unfinished and none left to arrive")
                wait(trace[i].arrival_time + t0)
            elif show_progress and engine.num_steps % 256 == 0:
                bar.set_postfix(t_s=f"{executor.now():.0f}", kv=f"{usage(engine.scheduler.block_manager):.0%}",
                                refresh=False)
    finally:
        engine.observers.remove(meter)
        bar.close()
    wall = time.perf_counter() - start
    whole, steady = meter.batch.mean(), meter.batch.steady_state_mean() or {}
    batch_sizes = {**whole, **{f"steady_{k}": steady.get(k) for k in whole}, "warmup_s": meter.batch.warmup_s}
    return TraceResult(records, num_rejected, engine.scheduler.num_preemptions, whole["requests_per_step"],
                       batch_sizes, kv.percentages() if kv is not None else None,
                       kv.steady_state_percentages() if kv is not None else None,
                       engine.num_steps, executor.now() - t0, wall, meter.token_times)
