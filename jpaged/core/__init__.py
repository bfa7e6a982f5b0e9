"""The engine's core: requests, the paged KV memory manager, the scheduler and the step contract.

Pure Python + numpy, no jax (tests/test_import_graph.py checks it, deferred and type-only imports
included): it imports only `jpaged.config` below it. Three rooms, each importing only the ones
listed before it:

- the contract (modules here): what the scheduler, the executors and the front ends exchange.
  Requests and their sequences (sequence), per-row sampling data (sampling_controls, constraints),
  the step plan handed to an executor and what it returns (step_plan, padding), and what the
  engine reports (outputs).
- `kv/`: memory. The KVCacheManager protocol (kv_manager), the block-table rows every manager
  shares (row_store), the paged implementation (block_manager, swap_space, prefix_cache, its host
  tier and eviction policies) and the per-step slot cursors (slot_cursor).
- `sched/`: scheduling. The scheduler's step passes (scheduler, step_draft, plan_builder), the
  running set and its persistent decode batch (running_set, persistent_batch), the waiting queue
  (admission, rejoin), the door (request_checks), what happens after a step (postprocess,
  beam_search, step_guard) and the overlapped loop's bookkeeping (overlap).
"""
