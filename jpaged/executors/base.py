"""The Executor interface shared by the real (JAX) executor and the cost-model simulator."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from jpaged.step_plan import StepPlan


@dataclasses.dataclass
class StepResult:
    """What one executed step returns to the engine."""

    logits: np.ndarray | None  # f32[num_seqs, vocab] next-token logits; None when the executor has no model (sim)
    duration: float  # seconds the step took: wall time (jax) or cost-model time (sim)


class Executor(Protocol):
    """Runs one step: block operations (swap out, swap in, copy-on-write), then the model."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Applies `plan`'s block ops in order swap_out, swap_in, copy, then runs its batch."""
        ...

    def now(self) -> float:
        """The executor's clock in seconds: wall time (jax) or the virtual clock (sim)."""
        ...
