"""A request that fails inside a step fails alone (issue 14): its output carries an error naming the
cause, the step completes for the others, their tokens stay exact, and every block comes back.

Requests are checked at the door, so the failures are injected: sampling settings changed after
the door (a frozen SamplingParams can still be changed with object.__setattr__), or scheduler
operations that raise for one request."""

import pytest

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.paper.sim.executor import SimExecutor
from tests.helpers.tiny_engines import dense_greedy, make_engine, run_to_end

PROMPT_A, PROMPT_B = [5, 6, 7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]


def run(engine):
    """Runs `engine` to the end; every block is free afterwards."""
    outputs = run_to_end(engine)
    stats = engine.kv_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_host_blocks"]
    assert not engine.scheduler.block_manager.refcount.any()
    assert engine.postprocessor.num_streaming == 0
    return outputs


def corrupt(engine, request_id, **fields):
    """Changes a queued request's sampling settings behind the door's back."""
    for name, value in fields.items():
        object.__setattr__(engine._groups[request_id].sampling_params, name, value)


def corrupt_seed(engine, request_id, seed):
    """Changes the seed a queued request's draws use (fixed when it was queued) behind the door's back."""
    engine._groups[request_id].seed = seed


@pytest.fixture(scope="module")
def greedy_a():
    return dense_greedy("tiny-opt", [PROMPT_A], 8)[0]


@pytest.fixture(scope="module")
def shared():
    """One tiny real engine for the tests that leave it clean (each checks that it does)."""
    return make_engine(prefix_caching=True)


def sim_engine():
    config = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64, num_host_blocks=0),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=256),
                          executor="sim")
    return LLMEngine(config, executor=SimExecutor(get_preset("opt-13b")))


@pytest.mark.parametrize("output_kind", ["final", "delta"])
def test_sampling_settings_that_cannot_reach_the_device_fail_only_their_request(shared, greedy_a, output_kind):
    """The executor fails building the sample arrays (seed -1 is no uint32); it raises before touching
    the pool, so the engine ends b with the cause and runs the same plan again without b's rows."""
    engine = shared
    engine.add_request("a", PROMPT_A, SamplingParams(max_tokens=8))
    engine.add_request("b", PROMPT_B, SamplingParams(max_tokens=8, temperature=0.8, seed=3, output_kind=output_kind))
    engine.step()
    corrupt_seed(engine, "b", -1)
    outputs = run(engine)
    assert outputs["a"].output_token_ids == [greedy_a] and outputs["a"].error is None
    assert outputs["b"].finish_reasons == ["abort"]
    assert "'b'" in outputs["b"].error and "-1" in outputs["b"].error
    # The engine goes on: a later request is served exactly.
    engine.add_request(f"c-{output_kind}", PROMPT_A, SamplingParams(max_tokens=8))
    assert run(engine)[f"c-{output_kind}"].output_token_ids == [greedy_a]


def test_a_failing_beam_group_on_the_simulator_leaves_the_clock_and_the_others_alone():
    engine = sim_engine()
    engine.add_request("a", PROMPT_A, SamplingParams(max_tokens=10, ignore_eos=True))
    engine.add_request("b", PROMPT_B, SamplingParams(n=3, use_beam_search=True, max_tokens=10))
    engine.step()
    engine.step()
    corrupt_seed(engine, "b", -5)  # the simulator seeds beam candidates with it
    outputs = run(engine)
    assert [len(t) for t in outputs["a"].output_token_ids] == [10] and outputs["a"].error is None
    assert "-5" in outputs["b"].error and "'b'" in outputs["b"].error
    assert engine.executor.num_steps == engine.num_steps  # each step timed once, failed tries not


def test_a_beam_score_that_overflows_fails_only_its_request(shared, greedy_a):
    """length_penalty pushed past its bound after the door: ranking the finished beams overflows in
    the postprocessor; b ends with the cause (its beams as they are), a is untouched."""
    engine = shared
    engine.add_request("a", PROMPT_A, SamplingParams(max_tokens=8))
    engine.add_request("b", PROMPT_B, SamplingParams(n=2, use_beam_search=True, max_tokens=3))
    engine.step()
    corrupt(engine, "b", length_penalty=1e308)
    outputs = run(engine)
    assert outputs["a"].output_token_ids == [greedy_a]
    assert "beam search step failed" in outputs["b"].error and "OverflowError" in outputs["b"].error
    assert outputs["b"].finished and all(r in ("abort", "length") for r in outputs["b"].finish_reasons)


def test_a_failing_fork_fails_only_its_request(shared, greedy_a, monkeypatch):
    engine = shared
    fork_seq = engine.scheduler.fork_seq

    def fork_failing_for_b(parent, child):
        if parent.group.request_id == "b":
            raise MemoryError("no block-table row left")
        fork_seq(parent, child)

    monkeypatch.setattr(engine.scheduler, "fork_seq", fork_failing_for_b)
    engine.add_request("a", PROMPT_A, SamplingParams(max_tokens=8))
    engine.add_request("b", PROMPT_B, SamplingParams(n=3, temperature=1.0, max_tokens=8))
    engine.add_request("c", PROMPT_B, SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=1))
    outputs = run(engine)
    assert outputs["a"].output_token_ids == [greedy_a]
    assert "forking sample 1 failed: MemoryError: no block-table row left" in outputs["b"].error
    assert outputs["c"].error is None and [len(t) for t in outputs["c"].output_token_ids] == [4, 4]


def test_a_failing_finish_fails_only_its_request(shared, greedy_a, monkeypatch):
    """A failure while finishing a sequence (freeing it) ends its request; the same step appends the
    other requests' tokens and finishes them."""
    engine = shared
    free_seq = engine.scheduler.free_seq

    def free_failing_for_b(seq):
        if seq.group.request_id == "b":
            raise RuntimeError("cannot free")
        free_seq(seq)

    monkeypatch.setattr(engine.scheduler, "free_seq", free_failing_for_b)
    engine.add_request("a", PROMPT_A, SamplingParams(max_tokens=8))
    engine.add_request("b", PROMPT_B, SamplingParams(n=2, temperature=1.0, max_tokens=8))  # both finish together
    outputs = run(engine)
    assert outputs["a"].output_token_ids == [greedy_a]
    assert outputs["b"].error.startswith("finishing failed: RuntimeError: cannot free")
    # Its output is its sequences as they were when it failed: the first had its last token, the
    # second was still to get it in the same loop.
    assert [len(t) for t in outputs["b"].output_token_ids] == [8, 7]


class FailingExecutor:
    """Wraps an executor; `fail` replaces what its next execute does."""

    def __init__(self, inner):
        self.inner, self.fail = inner, None
        self.vocab_size = inner.vocab_size

    @property
    def num_compilations(self):
        return self.inner.num_compilations

    def execute(self, plan):
        result = self.inner.execute(plan)
        if self.fail is not None:
            return self.fail(result)
        return result

    def now(self):
        return self.inner.now()


def test_a_failure_no_request_explains_propagates():
    """The engine never swallows an executor failure it cannot pin on a request."""
    engine = sim_engine()
    engine.executor = FailingExecutor(engine.executor)
    engine.add_request("a", PROMPT_A, SamplingParams(max_tokens=8))
    engine.step()

    def device_lost(result):
        raise RuntimeError("device lost")

    engine.executor.fail = device_lost
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()


def test_an_executor_returning_the_wrong_number_of_tokens_is_an_error():
    engine = sim_engine()
    engine.executor = FailingExecutor(engine.executor)
    engine.executor.fail = lambda result: result.__class__(result.token_ids[:0], None, None, None, 0.0)
    engine.add_request("a", PROMPT_A, SamplingParams(max_tokens=8))
    with pytest.raises(RuntimeError, match="returned 0 tokens for 1 sample rows"):
        engine.step()
