"""The Executor interface shared by the real (JAX) executor and the cost-model simulator
(`jpaged.paper.sim.executor`): a StepPlan in, a ModelOutput out (both in `jpaged.core.step_plan`)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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
