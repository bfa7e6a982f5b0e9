"""FasterTransformer's request-level batching (paper §6.1) as a policy over the engine's scheduler.

A batch forms only when the previous one has finished: the earliest-arrived waiting requests are
admitted, as many as memory allows (with contiguous max-length reservations that is
B = slots // max_model_len), and the batch then runs to completion; requests arriving meanwhile
wait for the next batch. Admission still goes through the per-step token budget, so one batch
may take several prefill steps; it stays open for admission only while the budget, not memory or
the batch size limit, is what stopped it. Everything else is the engine's scheduler, unchanged.
"""

from __future__ import annotations

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.kv.kv_manager import KVCacheManager
from jpaged.core.sched.scheduler import Scheduler, SchedulerOutput
from jpaged.paper.baselines.contiguous import ContiguousBlockManager


class RequestLevelScheduler(Scheduler):
    """Runs each admitted batch to completion before admitting the next (no iteration-level joins)."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, kv_manager: KVCacheManager | None = None):
        super().__init__(config, cache, kv_manager or ContiguousBlockManager(
            cache.num_blocks, cache.block_size, config.max_model_len, "max", max_seqs=config.max_num_seqs))
        self._batch_open = True  # True while the current batch may still admit requests

    def schedule(self) -> SchedulerOutput:
        """The engine's step, with admission closed from the moment a batch stops growing until it ends."""
        if not self.running and not self.swapped:
            self._batch_open = True
        out = self.schedule_step()
        if self._batch_open:  # the batch grows while admissions succeed and the next one would fit
            self._batch_open = bool(out.admitted) and self._head_fits()
        return out

    def _may_admit(self) -> bool:
        """Whether the current batch still admits requests."""
        return self._batch_open

    def _head_fits(self) -> bool:
        """Whether the next waiting request fits by memory and batch size (so only the token budget held it)."""
        if not self.waiting:
            return False
        group = self.waiting[0]
        if self.running_set.num_seqs + group.width > self.config.max_num_seqs:
            return False
        leader, kv = group.live_seqs()[0], self.block_manager
        return (kv.fits(len(leader), width=group.width, final_len=group.max_total_len)
                and kv.can_admit(len(leader), len(leader), width=group.width, final_len=group.max_total_len,
                                 headroom=self._headroom()))
