"""BroadcastExecutor and `follow` over a real plan channel, on the cost-model executor (no JAX):
the follower receives every plan process 0 runs, in order and equal to it, through swap preemption,
forks and seeded sampling; a request whose sampling settings cannot become arrays fails on process 0
before its plan is sent, and the retried plan is the one that reaches the follower."""

from __future__ import annotations

import threading

import numpy as np

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.core.sequence import SamplingParams
from jpaged.core.step_plan import ModelOutput
from jpaged.engine import LLMEngine
from jpaged.executors.plan_wire import decode_plan, encode_plan
from jpaged.executors.remote import BroadcastExecutor, follow
from jpaged.paper.sim.executor import SimExecutor
from tests.parallel.channel_pair import joined_pair

CONFIG = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=12, num_host_blocks=64, watermark=0.0),
                      scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                                preemption_mode="swap"),
                      executor="sim")


class Recording:
    """An executor that keeps each plan as the follower would see it (encoded and decoded at once:
    the scheduler edits its rows in later steps) and answers like the simulator."""

    def __init__(self):
        self.sim = SimExecutor(get_preset("opt-13b"))
        self.vocab_size, self.num_compilations, self.plans = None, 0, []

    def now(self) -> float:
        return self.sim.now()

    def execute(self, plan):
        output = self.sim.execute(plan)  # first: a failure here must not record the plan
        self.plans.append(decode_plan(b"".join(bytes(b) for b in encode_plan(plan))))
        return output


class Follower:
    """A follower's executor that keeps the decoded plans it is given."""

    vocab_size, num_compilations = None, 0

    def __init__(self):
        self.plans = []

    def now(self) -> float:
        return 0.0

    def execute(self, plan):
        self.plans.append(plan)
        return ModelOutput(token_ids=[], logprobs=None, top_ids=None, top_logprobs=None, duration=0.0)


def _assert_same(mine, theirs) -> None:
    for name in (*mine.DEVICE_ARRAYS, "copy_pairs", "swap_in_pairs", "swap_out_pairs"):
        assert np.array_equal(getattr(mine, name), getattr(theirs, name)), name
    assert (mine.num_seqs, mine.num_tokens, mine.max_query_len) == (theirs.num_seqs, theirs.num_tokens,
                                                                    theirs.max_query_len)
    assert (mine.sampling is None) == (theirs.sampling is None)
    if mine.sampling is not None:
        assert np.array_equal(mine.sampling.batch.seed, theirs.sampling.batch.seed)
        assert np.array_equal(mine.sampling.batch.logits_rows, theirs.sampling.batch.logits_rows)


def _run(requests) -> tuple[Recording, Follower, LLMEngine, int]:
    """Serves `requests` (a function of the engine) on process 0; returns both sides' records."""
    server, client = joined_pair({"x": 1}, {"x": 1}, timeout=10)
    leader, follower, box = Recording(), Follower(), {}
    thread = threading.Thread(target=lambda: box.update(steps=follow(follower, client)))
    thread.start()
    engine = LLMEngine(CONFIG, executor=BroadcastExecutor(leader, server))
    requests(engine)
    server.close()
    thread.join(10)
    client.close()
    assert server.error is None
    return leader, follower, engine, box["steps"]


def test_the_follower_runs_every_plan_in_order():
    def requests(engine):
        prompts = [list(range(1, 14)), list(range(3, 12)), list(range(5, 20))]
        engine.generate(prompts, [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(
            n=2, temperature=0.7, seed=5, max_tokens=10, ignore_eos=True), SamplingParams(max_tokens=9, logprobs=2)],
            use_tqdm=False)
        assert engine.scheduler.num_preemptions > 0

    leader, follower, engine, steps = _run(requests)
    assert steps == len(leader.plans) == len(follower.plans) == engine.num_steps
    for mine, theirs in zip(leader.plans, follower.plans):
        _assert_same(mine, theirs)


def test_a_request_that_cannot_be_encoded_fails_before_its_plan_is_sent():
    outputs = {}

    def requests(engine):
        engine.add_request("a", [1, 2, 3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True))
        engine.add_request("b", [6, 7, 8], SamplingParams(max_tokens=4, temperature=0.5, seed=1, ignore_eos=True))
        engine._groups["b"].seed = -1  # no uint32: the sampling batch cannot be built (behind the door's back)
        while engine.has_unfinished():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})

    leader, follower, _, steps = _run(requests)
    assert outputs["b"].error is not None and outputs["a"].error is None
    assert steps == len(leader.plans) == len(follower.plans)
    first = follower.plans[0]
    assert len(first.sampling) == 1  # only a's row: b's plan never left process 0
    for mine, theirs in zip(leader.plans, follower.plans):
        _assert_same(mine, theirs)
