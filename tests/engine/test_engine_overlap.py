"""The overlapped engine loop (scheduler.async_scheduling) gives the synchronous loop's outputs, token
for token: greedy and seeded, with stops, n > 1, logprobs, aborts, prefix caching and preemption
(swap and recompute); every request ends and every block comes back."""

import numpy as np
import pytest

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.executors.jax import JaxExecutor
from jpaged.paper.baselines.request_level import request_level_scheduler
from jpaged.paper.sim.executor import SimExecutor

EOS = 7
STOPS = tuple(range(3, 256, 11))  # stop token ids of the "stop" requests: some end early, some do not


def _engine(overlapped, *, num_blocks=64, preemption_mode="recompute", prefix_caching=False):
    config = EngineConfig(
        model=ModelConfig(name="tiny-opt", attention_backend="xla"),
        cache=CacheConfig(block_size=8, num_blocks=num_blocks, num_host_blocks=64, watermark=0.0,
                          enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=128,
                                  preemption_mode=preemption_mode, async_scheduling=overlapped))
    return LLMEngine(config, executor=JaxExecutor(config), eos_token_ids=(EOS,))


def _workload():
    """(request id, prompt, params): greedy and seeded, stop ids, EOS, n = 2, logprobs, a shared prefix."""
    rng = np.random.default_rng(1)
    shared = rng.integers(1, 256, size=17).tolist()
    requests = []
    for i, n in enumerate((3, 8, 9, 17, 30, 5, 41, 12, 20, 6)):
        prompt = (shared if i % 3 == 0 else []) + rng.integers(1, 256, size=n).tolist()
        kind = i % 5
        if kind == 0:
            params = SamplingParams(max_tokens=14 + i)
        elif kind == 1:
            params = SamplingParams(max_tokens=16, temperature=0.9, top_k=40, seed=100 + i)
        elif kind == 2:
            params = SamplingParams(max_tokens=24, stop_token_ids=STOPS, temperature=1.0, seed=i)
        elif kind == 3:
            params = SamplingParams(max_tokens=12, n=2, temperature=0.8, seed=7 + i)
        else:
            params = SamplingParams(max_tokens=10, logprobs=2, stop_token_ids=STOPS)
        requests.append((f"r{i}", prompt, params))
    return requests


def _serve(engine, requests, abort=None, max_steps=400):
    """Runs `requests` (and whatever the engine holds already) to the end (aborting `abort` = (request id, at step) on the way); the
    outputs by request id, each as (finish reasons, token ids, logprobs) per sample."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    done = {}
    for step in range(max_steps):
        if not engine.has_unfinished():
            break
        if abort is not None and step == abort[1]:
            engine.abort(abort[0])
        for output in engine.step():
            assert output.finished
            done[output.request_id] = [(c.finish_reason, c.token_ids, c.logprobs) for c in output.outputs]
    assert not engine.has_unfinished()
    assert {r[0] for r in requests} <= set(done)  # (and those queued before the call)
    stats = engine.kv_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    assert stats["num_free_host_blocks"] == stats["num_host_blocks"]
    return done


def _same_logprobs(a, b):
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(x.keys() == y.keys() and np.allclose(list(x.values()), list(y.values()))
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_overlapped_outputs_equal_synchronous(prefix_caching):
    requests = _workload()
    sync = _serve(_engine(False, prefix_caching=prefix_caching), requests)
    engine = _engine(True, prefix_caching=prefix_caching)
    overlapped = _serve(engine, requests)
    reasons = {r for samples in sync.values() for r, _, _ in samples}
    assert {"stop", "length"} <= reasons  # the workload reaches both kinds of end
    for request_id, samples in sync.items():
        got = overlapped[request_id]
        assert [(r, t) for r, t, _ in got] == [(r, t) for r, t, _ in samples], request_id
        assert all(_same_logprobs(a[2], b[2]) for a, b in zip(got, samples)), request_id
    assert engine.num_steps_ahead > 0  # the loop really ran ahead of its outputs
    assert engine.num_dropped_rows > 0  # and dropped the rows of sequences that had stopped


def test_overlapped_abort_mid_flight():
    requests = _workload()[:6]
    sync = _serve(_engine(False), requests, abort=("r0", 6))
    overlapped = _serve(_engine(True), requests, abort=("r0", 6))
    for request_id in sync:
        if request_id != "r0":
            assert [s[:2] for s in overlapped[request_id]] == [s[:2] for s in sync[request_id]], request_id
    # Aborted one step later in its tokens (they are applied one step behind): the same stream, cut earlier.
    (reason_s, tokens_s, _), = sync["r0"]
    (reason_o, tokens_o, _), = overlapped["r0"]
    assert reason_s == reason_o == "abort"
    assert 0 < len(tokens_o) <= len(tokens_s) and tokens_s[: len(tokens_o)] == tokens_o


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_overlapped_outputs_equal_synchronous_under_preemption(mode):
    requests = [r for r in _workload() if r[2].n == 1]
    sync_engine = _engine(False, num_blocks=20, preemption_mode=mode)
    sync = _serve(sync_engine, requests)
    engine = _engine(True, num_blocks=20, preemption_mode=mode)
    overlapped = _serve(engine, requests)
    assert sync_engine.kv_stats()["num_preemptions"] > 0 and engine.kv_stats()["num_preemptions"] > 0
    assert {k: [s[:2] for s in v] for k, v in overlapped.items()} == {k: [s[:2] for s in v] for k, v in sync.items()}
    assert engine.num_steps_ahead > 0


def test_async_scheduling_is_refused_where_it_cannot_apply():
    config = EngineConfig(model=ModelConfig(name="tiny-opt"), executor="sim",
                          scheduler=SchedulerConfig(async_scheduling=True))
    with pytest.raises(ValueError, match="scheduler.async_scheduling: not supported with RequestLevelBatching"):
        LLMEngine(config, executor=SimExecutor(get_preset("tiny-opt")),
                  scheduler=request_level_scheduler(config.scheduler, config.cache))

    class StepOnly:  # an Executor without launch / collect
        vocab_size = None
        num_compilations = 0

        def execute(self, plan):
            raise AssertionError("never runs")

        def now(self):
            return 0.0

    with pytest.raises(TypeError, match="scheduler.async_scheduling: StepOnly cannot overlap steps"):
        LLMEngine(config, executor=StepOnly())
    with pytest.raises((TypeError, ValueError), match="scheduler.async_scheduling"):
        SchedulerConfig(async_scheduling="yes")


def test_async_scheduling_is_an_engine_argument():
    """`LLM(..., async_scheduling=True)` and an engine YAML's `scheduler: {async_scheduling: true}`."""
    from jpaged.config import config_from_dict
    from jpaged.entrypoints.engine_args import engine_config

    assert engine_config("tiny-opt", async_scheduling=True).scheduler.async_scheduling is True
    assert config_from_dict(EngineConfig, {"scheduler": {"async_scheduling": True}}).scheduler.async_scheduling


def test_timed_simulator_overlaps_the_host_with_its_steps():
    """With the simulator's step time really waited for, the overlapped loop launches steps ahead
    and its outputs equal the synchronous loop's (lengths: the simulator's tokens are synthetic)."""
    results = {}
    for overlapped in (False, True):
        config = EngineConfig(model=ModelConfig(name="tiny-opt"), executor="sim",
                              scheduler=SchedulerConfig(async_scheduling=overlapped))
        executor = SimExecutor(get_preset("tiny-opt"), timed=True)
        engine = LLMEngine(config, executor=executor)
        outs = engine.generate([[1] * 5, [2] * 9, [3] * 3], [SamplingParams(max_tokens=m, ignore_eos=True)
                                                            for m in (6, 11, 3)], use_tqdm=False)
        results[overlapped] = [o.output_token_ids[0] for o in outs]
        assert executor.now() >= executor.busy_s  # every step's time was waited for
        if overlapped:
            assert engine.num_steps_ahead > 0
    assert results[True] == results[False] and [len(t) for t in results[True]] == [6, 11, 3]


def test_overlapped_request_failing_in_a_step_fails_alone():
    """b's seed is corrupted while a step scheduled ahead is in flight: sampling it fails, b ends with
    the cause, the step is collected again without b's row, and a's tokens stay exact."""
    from tests.helpers.tiny_engines import dense_greedy

    prompt_a, prompt_b = [5, 6, 7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]
    engine = _engine(True)
    engine.add_request("a", prompt_a, SamplingParams(max_tokens=8))
    engine.add_request("b", prompt_b, SamplingParams(max_tokens=8, temperature=0.8, seed=3))
    for _ in range(3):
        engine.step()
    assert engine.num_steps_ahead > 0
    engine._groups["b"].seed = -1  # (no uint32: its sample arrays cannot be built)
    done = _serve(engine, [])
    assert sorted(done) == ["a", "b"]
    assert done["a"][0][:2] == ("length", dense_greedy("tiny-opt", [prompt_a], 8)[0])
    assert done["b"][0][0] == "abort"
