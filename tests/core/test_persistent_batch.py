"""The persistent decode batch (jpaged.core.sched.persistent_batch) is an optimisation only: whenever a step skips
the per-row stop checks, no row could have stopped but those it names as reaching their length
limit, the table width is the one its contexts need, and every request ends exactly as it does
with the per-row checks on every step."""

import zlib

import numpy as np
import pytest

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from jpaged.core.sched import plan_builder, scheduler
from jpaged.core.padding import table_width
from jpaged.core.sequence import SamplingParams
from jpaged.core.step_plan import ModelOutput
from jpaged.engine import EngineObserver, LLMEngine

VOCAB = 40


class HashTokens:
    """No model: each sampled token is a hash of (request, position), so stop tokens are hit (and
    drafts of the same request's earlier tokens are sometimes right)."""

    vocab_size = VOCAB
    num_compilations = 0

    def __init__(self):
        self.clock = 0.0

    def execute(self, plan) -> ModelOutput:
        self.clock += 1e-3
        rows = plan.sampling
        if rows is None:
            return ModelOutput(token_ids=[], logprobs=None, top_ids=None, top_logprobs=None, duration=1e-3)
        offsets = rows.spec_offsets or [0] * len(rows.seqs)  # (a verify step's row j samples position len + j)
        tokens = [self.token(s.group.request_id, len(s) + j) for s, j in zip(rows.seqs, offsets)]
        return ModelOutput(token_ids=tokens, logprobs=np.full(len(tokens), -0.5, np.float32), top_ids=None,
                           top_logprobs=None, duration=1e-3)

    def token(self, request_id: str, position: int) -> int:
        return zlib.crc32(f"{request_id}/{position}".encode()) % VOCAB

    def now(self) -> float:
        return self.clock


class PeriodicTokens(HashTokens):
    """HashTokens repeating every 5 positions: prompt lookup's drafts are often right."""

    def token(self, request_id: str, position: int) -> int:
        return super().token(request_id, position % 5)


class CheckSkippedStops(EngineObserver):
    """Asserts, at every step, what a step that skips the per-row stop checks promises."""

    def __init__(self):
        self.num_skipping_steps = 0
        self.num_length_stops = 0  # rows those steps ended by length
        self.num_batch_steps = 0  # steps that ran the kept running batch alone
        self.num_mixed_steps = 0  # steps whose other rows (prompts) followed the batch's
        self.num_steps_after_verify = 0  # steps that skipped the checks right after a verify step
        self._verified = False  # the last step verified drafts (speculative decoding)

    def on_step_executed(self, engine, out, result, start, end):
        plan = out.plan
        bm = engine.scheduler.block_manager
        store = bm.rows
        if plan.num_seqs:
            longest = int(plan.context_lens[: plan.num_seqs].max())
            width = (store.max_blocks_per_seq if plan.max_query_len > 1
                     else table_width(-(-longest // bm.block_size), store.max_blocks_per_seq))
            assert plan.block_tables.shape[1] == width
        rows = plan.sampling
        after_verify, self._verified = self._verified, rows is not None and rows.spec_offsets is not None
        if rows is not None and out.batch is not None:  # the kept batch is what a rebuild would give
            scheduler = engine.scheduler
            # Its rows lead the step: the running sequences (partly prefilled groups aside) but those
            # with other rows in it (prompts admitted or finished by this step), each once, in the
            # batch's own order (rows move when others leave).
            n = rows.num_batch_rows
            fresh = rows.seqs[:n]
            others = {id(s) for s in plan.seqs[n:]}
            want = [s for g in scheduler.running if g not in scheduler.running_set.partial for s in g.live_seqs()
                    if id(s) not in others]
            assert sorted(s.seq_id for s in fresh) == sorted(s.seq_id for s in want)
            assert plan.seqs[:n] == fresh and out.batch.seqs == fresh and len({id(s) for s in fresh}) == n
            np.testing.assert_array_equal(out.batch.rows, store.rows_of([s.seq_id for s in fresh]))
            np.testing.assert_array_equal(plan.token_ids[:n], [s.token_ids[-1] for s in fresh])
            # ... and the cursor's arrays are the block manager's truth after the step's slots
            rows_of = store.rows_of([s.seq_id for s in fresh])
            ends = store.num_tokens[rows_of]
            np.testing.assert_array_equal(plan.context_lens[:n], ends)
            np.testing.assert_array_equal(plan.positions[:n], ends - 1)
            blocks = store.block_tables[rows_of, (ends - 1) // bm.block_size]
            np.testing.assert_array_equal(plan.slot_mapping[:n], blocks * bm.block_size + (ends - 1) % bm.block_size)
            width = plan.block_tables.shape[1]
            np.testing.assert_array_equal(plan.block_tables[:n], store.block_tables[rows_of, :width])
            assert not store.block_tables[rows_of, width:].any()
            assert not plan.block_tables[plan.num_seqs:].any()
            self.num_batch_steps += n == plan.num_seqs
            self.num_mixed_steps += n < plan.num_seqs
        if rows is None or rows.stop_tokens is None:
            return
        self.num_skipping_steps += 1
        self.num_steps_after_verify += after_verify
        self.num_length_stops += len(rows.length_stops)
        for r, seq in enumerate(rows.seqs[: rows.num_batch_rows]):
            if r in rows.length_stops:  # this step's token ends it by length
                assert len(seq.token_ids) + 1 == seq.group.max_total_len
            else:  # this step's token cannot end it by length
                assert len(seq.token_ids) + 1 < seq.group.max_total_len
            assert seq.group.stop_set <= rows.stop_tokens


def serve(policy, mode, block_size, num_blocks, observer=None, speculative=None, executor=HashTokens):
    """Serves a fixed mix of requests (stop tokens, EOS, lengths) to the end; outputs by request id."""
    config = EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, num_host_blocks=num_blocks,
                                            watermark=0.0, enable_prefix_caching=True),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=96,
                                                    policy=policy, preemption_mode=mode), executor="sim",
                          speculative=speculative or SpeculativeConfig())
    engine = LLMEngine(config, executor=executor(), eos_token_ids=[3])
    if observer is not None:
        engine.observers.append(observer)
    rng = np.random.default_rng(0)
    for i in range(24):
        prompt = rng.integers(4, VOCAB, int(rng.integers(2, 30))).tolist()
        params = SamplingParams(max_tokens=int(rng.integers(1, 50)), ignore_eos=bool(i % 3 == 0),
                                stop_token_ids=(5,) if i % 4 == 1 else (), n=2 if i % 5 == 2 else 1,
                                temperature=1.0, seed=i)
        engine.add_request(f"r{i}", prompt, params, arrival_time=0.0)
    outputs = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            break
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.has_unfinished()
    assert engine.scheduler.block_manager.num_free_blocks == num_blocks - 1
    return {k: (o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].cumulative_logprob)
            for k, o in outputs.items()}


@pytest.mark.parametrize("policy", ["paper", "chunked"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
@pytest.mark.parametrize("block_size,num_blocks", [(4, 40), (16, 12)])
def test_skipped_stop_checks_change_nothing(policy, mode, block_size, num_blocks, monkeypatch):
    observer = CheckSkippedStops()
    fast = serve(policy, mode, block_size, num_blocks, observer)
    assert observer.num_skipping_steps > 0 and observer.num_length_stops > 0 and observer.num_batch_steps > 0
    assert observer.num_mixed_steps > 0 or policy == "paper"  # (chunked: prompts join the batch's step)
    batch_plan, sample_rows = plan_builder.batch_plan, plan_builder.PlanBuilder._sample_rows

    def without_batch_stops(*args):  # every step through the per-row checks
        plan = batch_plan(*args)
        plan.sampling.stop_tokens = None
        return plan

    def mixed_without_batch_stops(self, all_single):
        rows = sample_rows(self, all_single)
        if rows is not None:
            rows.stop_tokens = None
        return rows

    monkeypatch.setattr(plan_builder, "batch_plan", without_batch_stops)  # (PlanBuilder.build's)
    monkeypatch.setattr(scheduler, "batch_plan", without_batch_stops)  # (the scheduler's decode fast path)
    monkeypatch.setattr(plan_builder.PlanBuilder, "_sample_rows", mixed_without_batch_stops)  # (mixed steps)
    assert serve(policy, mode, block_size, num_blocks) == fast


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_batch_kept_through_verify_steps_counts_its_length_limits_again(mode):
    # A verify step gives its sequences different numbers of tokens; the batch is kept, and the
    # decode steps after it still name exactly the rows their token brings to the length limit.
    # (The token depends on the request and position only: the same outputs as without.)
    observer = CheckSkippedStops()
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    with_drafts = serve("paper", mode, 4, 40, observer, speculative=ngram, executor=PeriodicTokens)
    assert observer.num_steps_after_verify > 0 and observer.num_length_stops > 0
    assert with_drafts == serve("paper", mode, 4, 40, executor=PeriodicTokens)
