"""The Executor interface shared by the real (JAX) executor and the cost-model simulator
(`jpaged.paper.sim.executor`): a StepPlan in, a ModelOutput out (both in `jpaged.core.step_plan`).

`OverlapExecutor` splits a step in two for the overlapped engine loop (`scheduler.async_scheduling`):
`launch` starts it and returns at once, `collect` samples it and waits for its tokens, so the host
can schedule the next step and apply the last one while the device runs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

from jpaged.core.step_plan import ModelOutput, StepPlan


@runtime_checkable
class Executor(Protocol):
    """Runs one step: block operations (swap out, swap in, copy-on-write), the model, sampling."""

    vocab_size: int | None  # the model's vocabulary: token ids the engine accepts (None: any)

    @property
    def num_compilations(self) -> int:
        """Step programs compiled so far (the engine's stats show that serving stops compiling;
        0 for an executor that compiles nothing)."""
        ...

    def execute(self, plan: StepPlan) -> ModelOutput:
        """Applies `plan`'s block ops in order swap_out, swap_in, copy, runs its batch and samples.

        Host-side preparation that reads a request's own data (its sampling settings: `plan.sampling`)
        comes before any state changes, so that such a failure leaves the executor as it was: the
        engine then ends that request with an error and calls `execute` again with the same plan,
        minus its sample rows. A failure after state changed is not retried; it propagates.
        """
        ...

    def now(self) -> float:
        """The executor's clock in seconds: wall time (jax) or the virtual clock (sim)."""
        ...


@dataclasses.dataclass
class PendingStep:
    """A launched step whose tokens are not collected yet."""

    plan: StepPlan  # the step; its `sampling` may lose rows before `collect` (sequences that ended since)
    started: float  # the executor's clock (`now`) when it was launched
    handle: Any  # the executor's own: the step's (logits, prompt scores) on device (jax), when they are ready (sim)


@runtime_checkable
class OverlapExecutor(Executor, Protocol):
    """An Executor whose steps can run while the host works (`execute` = `collect(launch(plan))`)."""

    def launch(self, plan: StepPlan) -> PendingStep:
        """Applies `plan`'s block ops and starts its batch; returns without waiting for the device.
        Launches run on the device in launch order (each step reads the pool the last one wrote)."""
        ...

    def collect(self, pending: PendingStep) -> ModelOutput:
        """Samples the rows `pending.plan.sampling` holds now and waits for their tokens. Reading a
        request's sampling settings (`SampleRows.batch`) comes before anything else: when it fails,
        nothing changed, and the engine may collect again with that request's rows removed."""
        ...
