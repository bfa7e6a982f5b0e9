"""Executors run a StepPlan: `jax` runs the real model and samples on device (sampling); the
cost-model simulator's executor is `jpaged.paper.sim.executor`."""
