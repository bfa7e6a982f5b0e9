"""Serving metrics: per-request latencies and throughput (vLLM's benchmark names), the paper's
normalized latency, batch occupancy over time, and the KV cache usage breakdown over time.

Time averages weight each executed step by its duration (busy time; idle gaps between steps, when
nothing is running, are left out). Besides the whole-run average, the accumulators keep a
steady-state average: from the first step during which the KV pool was full (the caller's
`pool_full` signal, see `KVUsageAccumulator.add`) to the end of the run, so that the warm-up while
the pool first fills (the first minutes of a trace) does not dilute it.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """Timestamps (seconds, one clock: wall or virtual) and lengths of one finished request."""

    request_id: int
    arrival_time: float  # the request reached the engine
    first_scheduled_time: float  # its first step started (end of queueing)
    first_token_time: float  # its first output token was produced
    finish_time: float  # its last output token was produced
    prompt_len: int  # prompt tokens
    output_len: int  # generated tokens (>= 1)


def _stats(name: str, values_s: np.ndarray) -> dict[str, float]:
    """mean / median / std / p90 / p99 of `values_s` (seconds) in ms, named like vLLM's benchmark."""
    if len(values_s) == 0:  # vLLM reports 0 when no request defines the metric (e.g. TPOT, all 1-token)
        values_s = np.zeros(1)
    ms = values_s * 1e3
    p90, p99 = np.percentile(ms, [90, 99])
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), f"p90_{name}_ms": float(p90), f"p99_{name}_ms": float(p99)}


def summarize_requests(records: Sequence[RequestRecord], duration_s: float | None = None) -> dict[str, float]:
    """Latency and throughput metrics of finished requests.

    normalized_latency_s is the paper's metric: mean over requests of end-to-end latency / output
    length (s/token). TTFT = first token - arrival; TPOT = (finish - first token) / (output - 1) over
    requests with more than one output token; E2EL = finish - arrival; queue = first scheduled -
    arrival. Throughputs divide by `duration_s`, by default last finish - first arrival.
    """
    if not records:
        raise ValueError("records must hold at least one finished request")
    arrival = np.array([r.arrival_time for r in records])
    scheduled = np.array([r.first_scheduled_time for r in records])
    first = np.array([r.first_token_time for r in records])
    finish = np.array([r.finish_time for r in records])
    prompt = np.array([r.prompt_len for r in records])
    output = np.array([r.output_len for r in records])
    if (output < 1).any():
        raise ValueError("records: every output_len must be >= 1")
    if not ((arrival <= scheduled) & (scheduled <= first) & (first <= finish)).all():
        raise ValueError("records: need arrival <= first_scheduled <= first_token <= finish")
    if duration_s is None:
        duration_s = float(finish.max() - arrival.min())
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    e2el = finish - arrival
    multi = output > 1
    summary = {
        "completed": len(records),
        "duration_s": duration_s,
        "total_input_tokens": int(prompt.sum()),
        "total_output_tokens": int(output.sum()),
        "request_throughput": len(records) / duration_s,  # requests/s
        "output_throughput": float(output.sum()) / duration_s,  # output tokens/s
        "total_token_throughput": float(prompt.sum() + output.sum()) / duration_s,  # tokens/s
        "normalized_latency_s": float((e2el / output).mean()),  # s/token
        "mean_queue_ms": float((scheduled - arrival).mean() * 1e3),
    }
    summary |= _stats("ttft", first - arrival)
    summary |= _stats("tpot", (finish - first)[multi] / (output[multi] - 1))
    summary |= _stats("e2el", e2el)
    return summary


def summarize_token_times(token_times: dict[str, list[float]]) -> dict[str, float]:
    """Inter-token latency (ITL): the gaps between consecutive tokens of each request, pooled over
    requests as vLLM's benchmark_serving pools them; mean / median / std / p90 / p99 in ms.

    `token_times` maps a request to the clock at each of its tokens (the trace runner records it).
    """
    gaps = [np.diff(times) for times in token_times.values() if len(times) > 1]
    return _stats("itl", np.concatenate(gaps) if gaps else np.zeros(0))


class _WindowedSums:
    """Duration-weighted sums of a few quantities over the whole run and over the steady state."""

    def __init__(self, size: int) -> None:
        self.whole = [0.0] * size  # sum of value x duration over every recorded step
        self.steady = [0.0] * size  # the same from the first pool-full step on
        self.whole_s = 0.0  # seconds recorded
        self.steady_s = 0.0  # seconds recorded since the window opened
        self.window_open = False

    def add(self, duration: float, values: tuple[float, ...], pool_full: bool) -> None:
        if duration < 0:
            raise ValueError(f"duration must be >= 0, got {duration}")
        self.window_open = self.window_open or pool_full
        for i, value in enumerate(values):
            self.whole[i] += value * duration
        self.whole_s += duration
        if self.window_open:
            for i, value in enumerate(values):
                self.steady[i] += value * duration
            self.steady_s += duration

    @property
    def warmup_s(self) -> float | None:
        """Recorded seconds before the steady-state window opened; None while it has not."""
        return self.whole_s - self.steady_s if self.window_open else None


class BatchOccupancyAccumulator:
    """The two batch sizes of a serving run (Fig. 13 and every batch-size plot), time-averaged.

    - requests per step: requests (sequence groups) with at least one token computed in the step;
      a step running 40 decode rows and the prompts of 2 new requests counts 42. The batch the GPU
      sees. Under prefill-only / decode-only steps (the paper's scheduler) prefill steps count only
      their prompts, which pulls this average down when prefill takes a large share of GPU time.
    - requests resident in the KV cache: requests holding at least one KV block on the device
      during the step, whether or not the step computes a token of theirs (a request swapped out
      to the host, or preempted for recompute, holds none). The batch the memory manager sustains.
    Both are averaged over executed steps weighted by step duration, over the whole run and over
    the steady state (module docstring).
    """

    def __init__(self) -> None:
        self._sums = _WindowedSums(2)

    def add(self, duration: float, requests_in_step: int, requests_resident: int, *, pool_full: bool = False) -> None:
        """Records a step of `duration` seconds; `pool_full` as in `KVUsageAccumulator.add`."""
        if min(requests_in_step, requests_resident) < 0:
            raise ValueError(f"request counts must be >= 0, got {requests_in_step}, {requests_resident}")
        self._sums.add(duration, (requests_in_step, requests_resident), pool_full)

    @staticmethod
    def _means(sums: list[float], seconds: float) -> dict[str, float]:
        in_step, resident = (v / seconds if seconds > 0 else 0.0 for v in sums)
        return {"requests_per_step": in_step, "requests_resident": resident}

    def mean(self) -> dict[str, float]:
        """Whole-run averages {requests_per_step, requests_resident} (0 when nothing was recorded)."""
        return self._means(self._sums.whole, self._sums.whole_s)

    def steady_state_mean(self) -> dict[str, float] | None:
        """Averages over the steady-state window; None when the pool never filled."""
        return self._means(self._sums.steady, self._sums.steady_s) if self._sums.window_open else None

    @property
    def warmup_s(self) -> float | None:
        """Recorded seconds before the pool first filled (None when it never did)."""
        return self._sums.warmup_s


class KVUsageAccumulator:
    """Time-averaged breakdown of the KV slot space (paper Fig. 2), in percent of all slots.

    At each step every one of the `total_slots` slots is in exactly one state:
    - token_states: holds the K/V of a token already in a live sequence;
    - reserved: allocated to a live request and will hold one of its future tokens (it will be
      written before the request finishes);
    - internal: allocated to a live request but will never hold a token (allocation rounding,
      over-reservation past the true output length, the unused tail of a last paged block);
    - external: free, yet unusable by the allocator for the request it must serve next (free buddy
      blocks too small for it); a paged pool has none, since any free block serves any request;
    - free: the rest, free and usable.
    `percentages()` averages the whole run; `steady_state_percentages()` the window from the first
    step during which the pool was full (module docstring), which leaves out the warm-up.
    """

    def __init__(self, total_slots: int) -> None:
        if total_slots < 1:
            raise ValueError(f"total_slots must be >= 1, got {total_slots}")
        self.total_slots = total_slots
        self._sums = _WindowedSums(4)  # slot-seconds of token_states, reserved, internal, external

    def add(self, duration: float, token_states: int, reserved: int, internal: int, external: int, *,
            pool_full: bool = False) -> None:
        """Records the slot counts of a step lasting `duration` seconds (its weight in the average).

        `pool_full`: the KV pool is full during this step: the allocator could not place the next
        waiting request (or had to preempt one) for lack of free memory. The first such step opens
        the steady-state window.
        """
        if min(token_states, reserved, internal, external) < 0:
            raise ValueError(f"slot counts must be >= 0, got {token_states}, {reserved}, {internal}, {external}")
        if token_states + reserved + internal + external > self.total_slots:
            raise ValueError(f"token_states + reserved + internal + external = "
                             f"{token_states + reserved + internal + external} exceeds total_slots "
                             f"{self.total_slots}")
        self._sums.add(duration, (token_states, reserved, internal, external), pool_full)

    def _percentages(self, sums: list[float], seconds: float) -> dict[str, float]:
        scale = 100.0 / (seconds * self.total_slots)
        token, reserved, internal, external = (s * scale for s in sums)
        return {"token_states_pct": token, "reserved_pct": reserved, "internal_frag_pct": internal,
                "external_frag_pct": external,
                "free_pct": max(0.0, 100.0 - token - reserved - internal - external)}  # no -1e-13 from rounding

    def percentages(self) -> dict[str, float]:
        """Whole-run time-averaged percent of all slots in each state; the five values sum to 100
        (up to float rounding)."""
        if self._sums.whole_s <= 0:
            raise ValueError("no step with a positive duration was recorded")
        return self._percentages(self._sums.whole, self._sums.whole_s)

    def steady_state_percentages(self) -> dict[str, float] | None:
        """The same over the steady-state window; None when the pool never filled (or no time passed)."""
        if not self._sums.window_open or self._sums.steady_s <= 0:
            return None
        return self._percentages(self._sums.steady, self._sums.steady_s)

    @property
    def warmup_s(self) -> float | None:
        """Recorded seconds before the pool first filled (None when it never did)."""
        return self._sums.warmup_s
