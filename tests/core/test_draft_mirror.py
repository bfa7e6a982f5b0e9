"""A draft model's runs beside the target's steps (jpaged.core.sched.draft_mirror): steps planned
while speculation is off skip the draft and record where each sequence's draft K/V stops; the next
mirrored step of a lagging sequence first computes its missing tokens, within a token budget, into
the slots its block table gives them. (On the real model, where only a correct catch-up keeps a
draft that is the target itself fully accepted: tests/engine/test_engine_speculative.py.)"""

import numpy as np

from jpaged.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from jpaged.core.kv.block_manager import BlockManager
from jpaged.core.sched import draft_mirror
from jpaged.core.sched.scheduler import Scheduler
from jpaged.core.sequence import SamplingParams, Sequence, SequenceGroup
from tests.helpers.kv import allocate


def _seq(seq_id: int, tokens: list[int]) -> Sequence:
    seq = Sequence(seq_id, tokens)
    SequenceGroup(f"r{seq_id}", [seq], SamplingParams(max_tokens=40), 0.0, 0)
    return seq


def test_catch_up_spends_its_budget_in_order_and_keeps_the_rest_lagging():
    a, b, c = _seq(1, list(range(10, 30))), _seq(2, list(range(40, 52))), _seq(3, [7] * 9)
    a.draft_lag, b.draft_lag = 5, 0  # c is complete
    plan = draft_mirror.CatchUp.of([a, b, c], [19, 11, 8], budget=20)
    assert plan.spans == [(a, 5, 19), (b, 0, 6)]  # 14 + 6 tokens
    assert plan.lags == [None, 6, None] and plan.lagging() == [False, True, False]
    assert a.draft_lag == 5  # nothing is recorded before `apply`
    # A lag at or past the step's first position misses nothing.
    b.draft_lag = 11
    assert draft_mirror.CatchUp.of([b], [11], budget=20).spans == []


def test_catchup_plan_computes_the_missing_tokens_into_their_slots():
    bm = BlockManager(12, 4, 0, max_model_len=32, watermark=0.0, max_seqs=4)
    a, b = _seq(1, list(range(100, 110))), _seq(2, list(range(200, 213)))
    rows = [allocate(bm, 1, 9), allocate(bm, 2, 12)]  # (a's last token, b's, not computed yet)
    a.draft_lag, b.draft_lag = 3, 10
    catch_up = draft_mirror.CatchUp.of([a, b], [9, 12], budget=64)
    plan = catch_up.apply(bm)
    assert a.draft_lag is None and b.draft_lag is None
    assert (plan.num_seqs, plan.num_tokens, plan.max_query_len) == (2, 8, 6)
    assert plan.sampling is None and plan.query_start_loc[:3].tolist() == [0, 6, 8]
    assert plan.token_ids[:8].tolist() == list(range(103, 109)) + [210, 211]
    assert plan.positions[:8].tolist() == [3, 4, 5, 6, 7, 8, 10, 11]
    tables = [bm.rows.block_tables[r] for r in rows]
    expected = [tables[i][p // 4] * 4 + p % 4 for i, span in ((0, range(3, 9)), (1, range(10, 12))) for p in span]
    assert plan.slot_mapping[:8].tolist() == expected
    assert plan.context_lens[:2].tolist() == [9, 12]
    np.testing.assert_array_equal(plan.block_tables[:2], np.stack(tables))


def _scheduler(threshold: int | None, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64),
                     CacheConfig(block_size=4, num_blocks=64),
                     speculative=SpeculativeConfig(method="draft_model", model="assets/none", num_speculative_tokens=2,
                                                   disable_by_batch_size=threshold))


def _decode(scheduler: Scheduler, out) -> None:
    """Appends token 1 to every sequence the plan samples for (as many as the verify step emits)."""
    rows = out.plan.sampling
    for seq in dict.fromkeys([] if rows is None else rows.seqs):
        seq.token_ids.append(1)
        if rows.spec_offsets is not None:  # accept every draft: the sequence keeps its slots
            seq.token_ids += [1] * (rows.seqs.count(seq) - 1)


def test_steps_above_the_threshold_skip_the_draft_and_the_first_step_below_catches_up():
    scheduler = _scheduler(threshold=3)
    groups = [SequenceGroup(f"r{i}", [Sequence(i, [5 + i] * 6)], SamplingParams(max_tokens=40, ignore_eos=True), 0.0, i)
              for i in range(3)]
    for group in groups:
        scheduler.add(group)
    out = scheduler.schedule()  # three prompts at once: speculation is off at 3
    assert not out.plan.draft_mirror and out.plan.draft_catchup is None
    assert [g.seqs[0].draft_lag for g in groups] == [0, 0, 0]
    _decode(scheduler, out)
    out = scheduler.schedule()  # their first decodes: still off, the lags stay where they started
    assert not out.plan.draft_mirror and [g.seqs[0].draft_lag for g in groups] == [0, 0, 0]
    _decode(scheduler, out)
    scheduler.abort(groups[2])
    out = scheduler.schedule()  # two left: a verify step, after the catch-up of 7 tokens each
    plan = out.plan
    assert plan.sampling.spec_offsets is not None and plan.draft_catchup is not None
    catchup = plan.draft_catchup
    assert catchup.num_seqs == 2 and catchup.query_start_loc[:3].tolist() == [0, 7, 14]
    assert catchup.positions[:14].tolist() == list(range(7)) * 2
    assert [g.seqs[0].draft_lag for g in groups[:2]] == [None, None]


def test_a_catch_up_past_the_budget_runs_over_several_steps_without_drafts():
    scheduler = _scheduler(threshold=2, budget=16)
    groups = [SequenceGroup(f"r{i}", [Sequence(i, [5 + i] * 6)], SamplingParams(max_tokens=40, ignore_eos=True), 0.0, i)
              for i in range(2)]
    for group in groups:
        scheduler.add(group)
    for _ in range(15):  # the prompts, then 14 decodes, at 2 sequences: off
        out = scheduler.schedule()
        assert not out.plan.draft_mirror
        _decode(scheduler, out)
    scheduler.abort(groups[1])
    seq = groups[0].seqs[0]  # 21 tokens, 20 computed, none in the draft's pool
    out = scheduler.schedule()  # 16 of them caught up: no drafts yet, the decode mirrored
    assert out.plan.draft_mirror and out.plan.sampling.spec_offsets is None
    assert out.plan.draft_catchup.positions[:16].tolist() == list(range(16)) and seq.draft_lag == 16
    _decode(scheduler, out)
    out = scheduler.schedule()  # the rest (again the mirrored 20: a lag is one number), and it drafts
    assert out.plan.sampling.spec_offsets is not None and seq.draft_lag is None
    assert out.plan.draft_catchup.positions[:out.plan.draft_catchup.num_tokens].tolist() == [16, 17, 18, 19, 20]
