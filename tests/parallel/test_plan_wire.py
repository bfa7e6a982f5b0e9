"""plan_wire: every plan a real scheduler makes (prompt chunks, decodes, swap and copy-on-write block
ops, n > 1 and seeded sampling, prompt log-probabilities) decodes to the same arrays, scalars,
sampling batch and prompt rows; bad bytes and fields that cannot travel are refused with their name."""

import dataclasses

import numpy as np
import pytest

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.executors.plan_wire import RemoteRows, decode_plan, encode_plan
from jpaged.paper.sim.executor import SimExecutor


def _recorded_plans() -> list:
    """The plans of a small swap-preempting, forking workload on the cost-model executor."""
    config = EngineConfig(cache=CacheConfig(block_size=4, num_blocks=12, num_host_blocks=64, watermark=0.0),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                                                    preemption_mode="swap"),
                          executor="sim")
    executor = SimExecutor(get_preset("opt-13b"))
    plans = []
    execute = executor.execute

    def record(plan):
        plans.append((plan, encode_plan(plan)))  # encoded when sent: later steps edit the scheduler's rows
        return execute(plan)

    executor.execute = record
    engine = LLMEngine(config, executor=executor)
    prompts = [list(range(1, 14)), list(range(3, 12)), list(range(5, 20))]
    engine.generate(prompts, [SamplingParams(max_tokens=12, ignore_eos=True), SamplingParams(
        n=2, temperature=0.7, seed=5, max_tokens=10, ignore_eos=True), SamplingParams(max_tokens=9, logprobs=2,
                                                                                    prompt_logprobs=3)],
        use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0
    return plans


def _same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_every_scheduled_plan_round_trips():
    plans = _recorded_plans()
    assert any(len(p.swap_out_pairs) for p, _ in plans) and any(len(p.copy_pairs) for p, _ in plans)
    assert any(p.prompt_rows is not None for p, _ in plans)
    for plan, buffers in plans:
        got = decode_plan(b"".join(bytes(b) for b in buffers))
        for field in dataclasses.fields(plan):
            if field.name in ("seqs", "sampling", "prompt_rows"):
                continue
            mine, theirs = getattr(plan, field.name), getattr(got, field.name)
            assert _same(mine, theirs) if isinstance(mine, np.ndarray) else mine == theirs, field.name
        assert got.seqs == []
        if plan.prompt_rows is None:
            assert got.prompt_rows is None
        else:  # what the executor reads; the requests stay on process 0
            mine, theirs = plan.prompt_rows, got.prompt_rows
            assert _same(mine.token_rows, theirs.token_rows) and _same(mine.targets, theirs.targets)
            assert theirs.num_top == mine.num_top == 3 and theirs.groups == []
        if plan.sampling is None:
            assert got.sampling is None
            continue
        assert isinstance(got.sampling, RemoteRows) and len(got.sampling) == len(plan.sampling)
        for field in dataclasses.fields(plan.sampling.batch):
            mine, theirs = getattr(plan.sampling.batch, field.name), getattr(got.sampling.batch, field.name)
            assert _same(mine, theirs) if isinstance(mine, np.ndarray) else mine == theirs, field.name


def test_truncated_or_padded_messages_are_refused():
    _, buffers = _recorded_plans()[0]
    data = b"".join(bytes(b) for b in buffers)
    with pytest.raises(ValueError, match=r"plan message: array \S+ needs \d+ bytes"):
        decode_plan(data[:-8])
    with pytest.raises(ValueError, match="left over"):
        decode_plan(data + b"\0")
    with pytest.raises(ValueError, match="shorter than its header"):
        decode_plan(b"\0")


def test_a_field_that_cannot_travel_is_named_before_anything_is_sent():
    plan, _ = _recorded_plans()[0]
    plan.num_prefill_tokens = [1, 2]  # not a scalar nor an array
    with pytest.raises(TypeError, match=r"plan\.num_prefill_tokens: a list cannot be sent"):
        encode_plan(plan)
