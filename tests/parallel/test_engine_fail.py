"""AsyncLLMEngine.fail, as the plan channel calls it when a follower is lost: with the step loop stuck
in a step that never returns (a collective whose peer died), the in-flight request and one waiting
to be queued end with the error, new requests are refused, and shutdown does not wait for the
stuck thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from jpaged.config import CacheConfig, EngineConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.entrypoints.async_engine import AsyncLLMEngine, EngineDeadError
from jpaged.executors.plan_channel import FollowerLost
from jpaged.paper.sim.executor import SimExecutor


class Stuck(SimExecutor):
    """Runs `free_steps` steps, then blocks until released (a step stuck in a collective)."""

    def __init__(self, free_steps: int):
        super().__init__(get_preset("opt-13b"))
        self.free_steps, self.stuck, self.release = free_steps, threading.Event(), threading.Event()

    def execute(self, plan):
        if self.num_steps >= self.free_steps:
            self.stuck.set()
            self.release.wait()
        return super().execute(plan)


def test_fail_ends_in_flight_and_queued_requests_while_the_step_is_stuck():
    config = EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64, num_host_blocks=0),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256),
                          executor="sim")
    executor = Stuck(free_steps=2)
    engine = AsyncLLMEngine(LLMEngine(config, executor=executor), tokenizer=None)
    lost = FollowerLost("process 1 is lost: its connection broke")

    async def main():
        params = SamplingParams(max_tokens=50, ignore_eos=True, output_kind="delta")
        stream = await engine.add_request("a", [1, 2, 3], params)
        first = await stream.__anext__()
        assert first.outputs[0].token_ids
        await asyncio.to_thread(executor.stuck.wait, 10)
        queued = asyncio.ensure_future(engine.add_request("b", [4, 5], params))  # never reaches the stuck loop
        await asyncio.sleep(0.1)
        assert not queued.done()
        threading.Thread(target=engine.fail, args=(lost,)).start()  # from the channel's thread
        with pytest.raises(EngineDeadError, match="process 1 is lost"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError, match="process 1 is lost"):
            await asyncio.wait_for(queued, 5)
        with pytest.raises(EngineDeadError, match="process 1 is lost"):
            await engine.add_request("c", [6], params)
        assert engine.is_dead and engine.error is lost
        start = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - start < 1.0

    try:
        asyncio.run(main())
    finally:
        executor.release.set()
