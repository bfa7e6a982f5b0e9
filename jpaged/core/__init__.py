"""The engine's core: requests, the paged KV memory manager, the scheduler and the step contract.

Pure Python + numpy, no jax (tests/test_import_graph.py checks it, deferred and type-only imports
included): it imports only `jpaged.config` below it. Sequences (sequence); the KVCacheManager
protocol (kv_manager), the block-table rows every manager shares (row_store) and the paged
implementation (block_manager, swap_space, prefix_cache); the running batch and its decode cursor
(decode_batch, decode_cursor); the host/device contract (step_plan, padding) and how the scheduler
fills it (plan_builder, step_draft); the scheduler and its parts (scheduler: the step's passes;
running_batch: the running set and the decode fast path; admission: the waiting queue; rejoin: a
recomputed group's sequences sharing their history again); what happens after a step
(postprocess, beam_search, step_guard); the door (request_checks) and what the engine reports
(outputs).
"""
