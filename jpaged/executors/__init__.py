"""Executors run a StepPlan: `jax` runs the real model, `sim` advances a virtual clock by a cost model."""
