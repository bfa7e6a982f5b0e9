"""Baselines of the paper's §6.1 behind the engine's memory interface: Orca's contiguous buddy
allocation with its reservation policies (buddy, contiguous) and FasterTransformer's
request-level batching (request_level)."""

from jpaged.paper.baselines.buddy import BuddyAllocator, reservation
from jpaged.paper.baselines.contiguous import ContiguousBlockManager
from jpaged.paper.baselines.request_level import RequestLevelBatching, request_level_scheduler

__all__ = ["BuddyAllocator", "ContiguousBlockManager", "RequestLevelBatching", "request_level_scheduler",
           "reservation"]
