"""Metrics: hand-computed request summaries; KV breakdown that tiles the slot space every step."""

import numpy as np
import pytest

from jpaged.paper.baselines.buddy import BuddyAllocator, reservation
from jpaged.paper.metrics import BatchOccupancyAccumulator, KVUsageAccumulator, RequestRecord, summarize_requests


def test_request_summary_hand_case():
    records = [
        # arrival, scheduled, first token, finish, prompt, output
        RequestRecord(0, 0.0, 0.5, 1.0, 3.0, 10, 5),  # e2e 3 -> 0.6 s/token; tpot (3-1)/4 = 0.5
        RequestRecord(1, 1.0, 1.0, 1.5, 5.0, 20, 1),  # e2e 4 -> 4 s/token; no tpot (one token)
    ]
    s = summarize_requests(records)
    assert s["duration_s"] == 5.0 and s["completed"] == 2
    assert s["request_throughput"] == pytest.approx(0.4)
    assert s["output_throughput"] == pytest.approx(6 / 5)
    assert s["total_token_throughput"] == pytest.approx(36 / 5)
    assert s["normalized_latency_s"] == pytest.approx((0.6 + 4.0) / 2)
    assert s["mean_ttft_ms"] == pytest.approx(750.0) and s["median_ttft_ms"] == pytest.approx(750.0)
    assert s["mean_tpot_ms"] == pytest.approx(500.0) and s["p99_tpot_ms"] == pytest.approx(500.0)
    assert s["mean_e2el_ms"] == pytest.approx(3500.0)
    assert s["p99_e2el_ms"] == pytest.approx(3000 + 0.99 * 1000)  # linear interpolation, like numpy
    assert s["mean_queue_ms"] == pytest.approx(250.0)
    assert summarize_requests(records, duration_s=10.0)["request_throughput"] == pytest.approx(0.2)


def test_request_summary_rejects_bad_records():
    with pytest.raises(ValueError, match="records"):
        summarize_requests([])
    with pytest.raises(ValueError, match="arrival <= first_scheduled"):
        summarize_requests([RequestRecord(0, 1.0, 0.5, 1.0, 2.0, 4, 4)])


def test_batch_occupancy_both_definitions_and_steady_state():
    acc = BatchOccupancyAccumulator()
    # Warm-up: 2 s of decode steps over 4 resident requests; then the pool fills.
    acc.add(2.0, 4, 4)
    # A 1 s prefill step of 2 new prompts while 10 requests are resident (8 decoding ones wait),
    # then 3 s of decode steps over all 10.
    acc.add(1.0, 2, 10, pool_full=True)
    acc.add(3.0, 10, 10)
    assert acc.mean() == pytest.approx({"requests_per_step": (8 + 2 + 30) / 6, "requests_resident": (8 + 10 + 30) / 6})
    assert acc.steady_state_mean() == pytest.approx({"requests_per_step": 32 / 4, "requests_resident": 10.0})
    assert acc.warmup_s == pytest.approx(2.0)
    never = BatchOccupancyAccumulator()
    never.add(1.0, 3, 3)
    assert never.steady_state_mean() is None and never.warmup_s is None
    assert BatchOccupancyAccumulator().mean() == {"requests_per_step": 0.0, "requests_resident": 0.0}
    with pytest.raises(ValueError, match="request counts"):
        acc.add(1.0, -1, 2)
    with pytest.raises(ValueError, match="duration"):
        acc.add(-1.0, 1, 2)


def test_kv_steady_state_window_leaves_out_the_warm_up():
    acc = KVUsageAccumulator(100)
    acc.add(3.0, 10, 0, 0, 0)  # warm-up: the pool fills slowly
    acc.add(1.0, 90, 5, 5, 0, pool_full=True)
    acc.add(1.0, 80, 10, 5, 0)  # the window stays open once the pool has filled
    whole, steady = acc.percentages(), acc.steady_state_percentages()
    assert whole["token_states_pct"] == pytest.approx((30 + 90 + 80) / 5)
    assert steady["token_states_pct"] == pytest.approx(85.0) and steady["free_pct"] == pytest.approx(2.5)
    assert sum(steady.values()) == pytest.approx(100.0) and acc.warmup_s == pytest.approx(3.0)
    never = KVUsageAccumulator(100)
    never.add(1.0, 10, 0, 0, 0)
    assert never.steady_state_percentages() is None and never.warmup_s is None


def test_kv_breakdown_of_a_buddy_run_tiles_the_slot_space():
    """Orca-style steps on a buddy allocator: the four parts plus usable free equal the space."""
    total, rng = 4096, np.random.default_rng(0)
    buddy, acc = BuddyAllocator(total), KVUsageAccumulator(total)
    live = {}  # offset -> [tokens so far, final length, reservation]
    head = None  # (prompt, output) of the next request waiting for memory
    for _ in range(400):
        if head is None:
            head = (int(rng.integers(4, 300)), int(rng.integers(4, 300)))
        offset = buddy.allocate(reservation("pow2", *head))
        if offset is not None:
            live[offset] = [head[0], sum(head), reservation("pow2", *head)]
            head = None
        for offset, state in list(live.items()):
            state[0] += 1
            if state[0] == state[1]:
                buddy.free(offset)
                del live[offset]
        tokens = sum(s[0] for s in live.values())
        reserved = sum(s[1] - s[0] for s in live.values())
        internal = sum(buddy.allocated_size(o) - s[1] for o, s in live.items())
        external = buddy.external_fragmentation(reservation("pow2", *head)) if head else 0
        usable_free = buddy.free_units - external
        assert tokens + reserved + internal + external + usable_free == total
        acc.add(0.01, tokens, reserved, internal, external)
    pct = acc.percentages()
    assert sum(pct.values()) == pytest.approx(100.0)
    assert all(v >= 0 for v in pct.values()) and pct["token_states_pct"] > 0


def test_kv_accumulator_hand_case_and_checks():
    acc = KVUsageAccumulator(100)
    acc.add(1.0, 50, 10, 5, 5)
    acc.add(3.0, 10, 0, 0, 0)
    pct = acc.percentages()
    assert pct["token_states_pct"] == pytest.approx((50 + 30) / 4)
    assert pct["reserved_pct"] == pytest.approx(2.5) and pct["external_frag_pct"] == pytest.approx(1.25)
    assert pct["free_pct"] == pytest.approx(100 - 20 - 2.5 - 1.25 - 1.25)
    with pytest.raises(ValueError, match="exceeds total_slots"):
        acc.add(1.0, 90, 10, 1, 0)
    with pytest.raises(ValueError, match="no step"):
        KVUsageAccumulator(10).percentages()
