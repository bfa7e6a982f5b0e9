"""One scheduling step in progress: the plan being built, the token budget left, what happened to groups.

`Scheduler.schedule` makes one `StepDraft` and hands it to its passes (running groups, swap-in,
admission) in turn; each takes tokens from the budget, adds rows and block operations to the
builder and records admissions, rejections and preemptions. The draft becomes the step's
`SchedulerOutput`. Pure Python: no jax import.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jpaged.core.sched.plan_builder import PlanBuilder
    from jpaged.core.sequence import Sequence, SequenceGroup


@dataclasses.dataclass(slots=True)
class StepDraft:
    """What one `Scheduler.schedule` has decided so far."""

    builder: PlanBuilder  # the plan's rows and block operations
    tokens: int  # token budget left: max_num_batched_tokens less the tokens scheduled so far
    held_back: bool = False  # admission stopped for lack of blocks
    admitted: list[SequenceGroup] = dataclasses.field(default_factory=list)  # groups scheduled for the first time
    rejected: list[tuple[SequenceGroup, str]] = dataclasses.field(default_factory=list)  # never runnable, and why
    num_preempted: int = 0  # groups preempted (swapped out or back to waiting)

    def add_chunk(self, seq: Sequence, count: int, row: int | None = None) -> None:
        """Slots for the next `count` tokens of a resident sequence (`row`: its block-table row,
        if known), whose room was checked, added to the plan and taken from the budget."""
        kv = self.builder.kv
        if row is None:
            row = kv.rows.row_of(seq.seq_id)
        slots, copies = kv.append_row(row, count)
        self.builder.add_chunk(seq, row, count, kv.rows.num_slots(seq.seq_id), slots, copies)
        self.tokens -= count
