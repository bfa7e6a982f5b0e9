"""Memory: the KV-cache manager protocol and the paged pool that implements it.

Block ids, reference counts, block tables (row_store), copy-on-write, swap (swap_space), the radix
prefix cache with its host tier and eviction policies, and the cursors that hand out one slot per
sequence per decode step (slot_cursor). Imports the core's contract modules, never `core.sched`.
"""
