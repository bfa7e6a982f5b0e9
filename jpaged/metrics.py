"""Serving metrics: per-request latencies and throughput (vLLM's benchmark names), the paper's
normalized latency, the average batch size, and the KV cache usage breakdown over time.
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


class BatchSizeAccumulator:
    """Average number of batched requests (Fig. 13): steps weighted by their duration."""

    def __init__(self) -> None:
        self._weighted = 0.0  # sum of num_seqs x duration, seq-seconds
        self._time = 0.0  # sum of durations of recorded steps, seconds

    def add(self, duration: float, num_seqs: int) -> None:
        """Records a step of `duration` seconds that ran `num_seqs` sequences."""
        self._weighted += num_seqs * duration
        self._time += duration

    def mean(self) -> float:
        """Time-averaged batch size over the recorded steps (0 when none)."""
        return self._weighted / self._time if self._time > 0 else 0.0


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
    """

    def __init__(self, total_slots: int) -> None:
        if total_slots < 1:
            raise ValueError(f"total_slots must be >= 1, got {total_slots}")
        self.total_slots = total_slots
        self._sums = [0.0, 0.0, 0.0, 0.0]  # slot-seconds of token_states, reserved, internal, external
        self._time = 0.0  # seconds recorded

    def add(self, duration: float, token_states: int, reserved: int, internal: int, external: int) -> None:
        """Records the slot counts of a step lasting `duration` seconds (its weight in the average)."""
        if min(token_states, reserved, internal, external) < 0:
            raise ValueError(f"slot counts must be >= 0, got {token_states}, {reserved}, {internal}, {external}")
        if token_states + reserved + internal + external > self.total_slots:
            raise ValueError(f"token_states + reserved + internal + external = "
                             f"{token_states + reserved + internal + external} exceeds total_slots "
                             f"{self.total_slots}")
        if duration < 0:
            raise ValueError(f"duration must be >= 0, got {duration}")
        sums = self._sums
        sums[0] += token_states * duration
        sums[1] += reserved * duration
        sums[2] += internal * duration
        sums[3] += external * duration
        self._time += duration

    def percentages(self) -> dict[str, float]:
        """Time-averaged percent of all slots in each state; the five values sum to 100."""
        if self._time <= 0:
            raise ValueError("no step with a positive duration was recorded")
        scale = 100.0 / (self._time * self.total_slots)
        token, reserved, internal, external = (s * scale for s in self._sums)
        return {"token_states_pct": token, "reserved_pct": reserved, "internal_frag_pct": internal,
                "external_frag_pct": external, "free_pct": 100.0 - token - reserved - internal - external}
