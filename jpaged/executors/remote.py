"""One scheduler, many executors: process 0 sends every StepPlan to the followers, which run it too.

In a multi-process run (`model.num_processes > 1`) every process holds a shard of the model and the
KV pool, and every process must launch the same jitted programs in the same order (JAX's
multi-controller model). Only process 0 schedules: `BroadcastExecutor` wraps its executor, sends
each plan over the plan channel (jpaged.executors.plan_channel) and then runs it; each follower runs
`follow`, which executes the plans it receives on its own executor and acknowledges each one. The
engine sees an ordinary Executor. Only process 0's sampled tokens are used: a follower's are dropped.
"""

from __future__ import annotations

from jpaged.core.padding import bucket
from jpaged.core.step_plan import ModelOutput, StepPlan
from jpaged.executors.base import Executor
from jpaged.executors.plan_channel import PlanClient, PlanServer
from jpaged.executors.plan_wire import decode_plan, encode_plan


class BroadcastExecutor:
    """Process 0's executor: sends each plan to every follower, then runs it on `inner`."""

    def __init__(self, inner: Executor, channel: PlanServer):
        self.inner, self.channel = inner, channel
        self.vocab_size = inner.vocab_size
        self.kv_cache = getattr(inner, "kv_cache", None)  # the device pool's size (jpaged.engine.sized_config)
        self._shapes: set[tuple] = set()  # step shapes sent before (`_shape_key`)

    @property
    def num_compilations(self) -> int:
        """Step programs compiled on this process (the followers compile the same ones)."""
        return self.inner.num_compilations

    def now(self) -> float:
        """The inner executor's clock."""
        return self.inner.now()

    def execute(self, plan: StepPlan) -> ModelOutput:
        """Sends `plan`, then runs it here. Encoding builds the sampling batch first, so a request whose
        settings cannot become arrays fails before any follower saw the plan (the engine's retry
        without its rows then reaches the followers as the next plan). Raises FollowerLost once
        the channel lost a follower. A step of a shape not sent before may compile: the channel
        then allows it the compile timeout."""
        buffers = encode_plan(plan)
        key = _shape_key(plan)
        self.channel.send_plan(buffers, may_compile=key not in self._shapes)
        self._shapes.add(key)
        return self.inner.execute(plan)


def _shape_key(plan: StepPlan) -> tuple:
    """What decides which programs a step runs: its padded batch shape and kind, the buckets of its
    block-op pairs, of its sample rows and of their top candidates (jpaged.executors.jax and .sampling
    pad to these). A new key may mean a compilation; a known one should not."""
    rows = 0 if plan.sampling is None else bucket(len(plan.sampling))
    num_top = 0 if plan.sampling is None else bucket(plan.sampling.batch.num_top, minimum=1)
    pairs = tuple(bucket(len(p), minimum=4) for p in (plan.copy_pairs, plan.swap_in_pairs, plan.swap_out_pairs))
    return plan.padded_shape, plan.max_query_len == 1, pairs, rows, num_top


def follow(executor: Executor, channel: PlanClient) -> int:
    """Runs process 0's plans on `executor` until it says stop; returns the number of steps run.

    An error while decoding or running a step is reported to process 0 (which then fails its
    requests) and raised.
    """
    step = 0
    try:
        for payload in channel.plans():
            executor.execute(decode_plan(payload))
            step += 1
            channel.ack(step)
    except Exception as exc:
        channel.report(exc)
        raise
    return step
