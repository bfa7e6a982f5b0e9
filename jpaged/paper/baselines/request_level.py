"""FasterTransformer's request-level batching (paper §6.1) as a batching rule for the engine's scheduler.

A batch forms only when the previous one has finished: the earliest-arrived waiting requests are
admitted, as many as memory allows (with contiguous max-length reservations that is
B = slots // max_model_len), and the batch then runs to completion; requests arriving meanwhile
wait for the next batch. Admission still goes through the per-step token budget, so one batch
may take several prefill steps; it stays open for admission only while the budget, not memory or
the batch size limit, is what stopped it. Everything else is the engine's scheduler, unchanged:
the rule is handed to it (`Scheduler(..., batching=RequestLevelBatching())`).
"""

from __future__ import annotations

from jpaged.config import CacheConfig, SchedulerConfig
from jpaged.core.sched.scheduler import Scheduler, SchedulerOutput
from jpaged.paper.baselines.contiguous import ContiguousBlockManager


class RequestLevelBatching:
    """Runs each admitted batch to completion before admitting the next (no iteration-level joins)."""

    def __init__(self):
        self.batch_open = True  # True while the current batch may still admit requests

    def may_admit(self, scheduler: Scheduler) -> bool:
        """Open when nothing runs (a new batch forms); else as the last step left it."""
        if not scheduler.running and not scheduler.swapped:
            self.batch_open = True
        return self.batch_open

    def stepped(self, scheduler: Scheduler, out: SchedulerOutput) -> None:
        """The batch grows while admissions succeed and the next request would fit."""
        if self.batch_open:
            self.batch_open = bool(out.admitted) and _head_fits(scheduler)


def request_level_scheduler(config: SchedulerConfig, cache: CacheConfig) -> Scheduler:
    """FasterTransformer's scheduler: request-level batching over max-length contiguous reservations."""
    manager = ContiguousBlockManager(cache.sized_num_blocks, cache.block_size, config.max_model_len, "max",
                                     max_seqs=config.max_num_seqs)
    return Scheduler(config, cache, manager, batching=RequestLevelBatching())


def _head_fits(scheduler: Scheduler) -> bool:
    """Whether the next waiting request fits by memory and batch size (so only the token budget held it)."""
    if not scheduler.waiting:
        return False
    group = scheduler.waiting[0]
    if scheduler.running_set.num_seqs + group.width > scheduler.config.max_num_seqs:
        return False
    leader, kv = group.live_seqs()[0], scheduler.block_manager
    return (kv.fits(len(leader), width=group.width, final_len=group.max_total_len)
            and kv.can_admit(len(leader), len(leader), width=group.width, final_len=group.max_total_len,
                             headroom=scheduler.headroom()))
