"""FasterTransformer's request-level batching (paper §6.1) as a policy over the engine's scheduler.

A batch forms only when the previous one has finished: the earliest-arrived waiting requests are
admitted, as many as memory allows (with contiguous max-length reservations that is
B = slots // max_model_len), and the batch then runs to completion; requests arriving meanwhile
wait for the next batch. Admission still goes through the per-step token budget, so one batch
may take several prefill steps; it stays open for admission only while the budget, not memory or
the batch size limit, is what stopped it.
"""

from __future__ import annotations

from jpaged.baselines.contiguous import ContiguousBlockManager
from jpaged.block_manager import AllocStatus
from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.scheduler import Scheduler, SchedulerOutput
from jpaged.sequence import SequenceStatus


class RequestLevelScheduler(Scheduler):
    """Runs each admitted batch to completion before admitting the next (no iteration-level joins)."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig,
                 block_manager: ContiguousBlockManager | None = None):
        super().__init__(config, cache, block_manager or ContiguousBlockManager(
            cache.num_blocks, cache.block_size, config.max_model_len, "max", max_seqs=config.max_num_seqs))
        self._batch_open = True  # True while the current batch may still admit requests

    def schedule(self) -> SchedulerOutput:
        """A prefill step while the batch forms, else a decode step of the running batch."""
        rejected = []
        if not self.running and not self.swapped:
            self._batch_open = True
        if self._batch_open:
            prefill = self._schedule_prefill(rejected)
            self._batch_open = prefill is not None and self._head_fits()
            if prefill is not None:
                return prefill
        return self._schedule_decode(rejected)

    def _head_fits(self) -> bool:
        """Whether the next waiting request fits by memory and batch size (so only the token budget held it)."""
        if not self.waiting:
            return False
        group = self.waiting[0]
        seqs = group.live_seqs(SequenceStatus.WAITING)
        if len(self._running_batch()[0]) + len(seqs) > self.config.max_num_seqs:
            return False
        final_len = group.prompt_len + group.sampling_params.max_tokens
        status = self.block_manager.can_allocate(max(len(s) for s in seqs), num_seqs=len(seqs), final_len=final_len)
        return status is AllocStatus.OK
