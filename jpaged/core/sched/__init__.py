"""Scheduling: which sequences run in a step, how the step's plan is built, and what follows it.

The token-budget scheduler and its passes (scheduler, step_draft, plan_builder), the running set
and its persistent decode batch (running_set, persistent_batch), the waiting queue and a
recomputed group's rejoin (admission, rejoin), the door's request checks, the postprocessor with
beam search and the step guard, and the overlapped loop's bookkeeping (overlap). Talks to memory
only through `core.kv.kv_manager.KVCacheManager`.
"""
