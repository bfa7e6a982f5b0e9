"""The Executor interface shared by the real (JAX) executor and the cost-model simulator."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from jpaged.core.step_plan import StepPlan


@dataclasses.dataclass
class ModelOutput:
    """What one executed step returns to the engine core: a token per sample row, not logits."""

    token_ids: np.ndarray | list[int]  # [R] the token sampled for each row of plan.sampling
    logprobs: np.ndarray | None  # f32[R] log-probability of each sampled token; None without a model
    top_ids: np.ndarray | None  # i32[R, K] most likely tokens per row, best first (beams, logprobs), else None
    top_logprobs: np.ndarray | None  # f32[R, K] their log-probabilities
    duration: float  # seconds the step took: wall time (jax) or cost-model time (sim)


class Executor(Protocol):
    """Runs one step: block operations (swap out, swap in, copy-on-write), the model, sampling."""

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
