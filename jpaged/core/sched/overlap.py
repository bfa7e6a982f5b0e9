"""The one-step-behind bookkeeping of the overlapped engine loop (vLLM's async scheduling).

The overlapped engine schedules step n+1 while step n runs on the device, and applies step n's
tokens (appends, stop checks, frees, outputs) after step n+1 was launched. Only the decode fast
path is scheduled ahead (`Scheduler.schedule_decode`): step n was the running batch's decode step
alone and the batch did not change since, so step n+1's rows are step n's rows in the same order
and its input ids are step n's sampled tokens (`feed`). Everything step n+1 needs from step n's
tokens is read when it is sampled, after step n was applied: the position and the sampling
controls of each row (`SampleRows.batch`). A sequence that ended with step n (a stop token, its
length limit, an abort) still has a row in step n+1: that row is dropped before step n+1 is
sampled (`drop_finished_rows`), so its token is never applied. Every other kind of step (prompts,
forks, beams, preemption, swaps) runs after the step before it was applied, as in the synchronous
loop. Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import numpy as np

from jpaged.core.sched.scheduler import SchedulerOutput
from jpaged.core.sched.step_guard import subset
from jpaged.core.step_plan import SampleRows, StepPlan


def can_follow(out: SchedulerOutput) -> bool:
    """Whether the step after `out` may be scheduled before `out`'s tokens are applied: `out`
    samples exactly the running batch's decode rows, in the batch's order, and not every row
    reaches its length limit with them (a step after would be all dropped rows)."""
    rows = out.plan.sampling
    return (out.batch is not None and rows is not None and not out.admitted and rows.num_batch_rows == len(rows)
            == len(out.batch) and len(rows.length_stops) < len(rows))


def feed(plan: StepPlan, before: SampleRows | None, tokens: np.ndarray | list[int]) -> None:
    """Writes the tokens the step before sampled (`tokens[r]` for row r of `before`) as the input
    ids of `plan`, that step's follower scheduled ahead (it could not read them from the token
    lists). Its batch rows are `before`'s, in the same order, unless rows were removed while
    collecting (a request failed): then they are matched by sequence, and the removed rows'
    inputs stay as they are (those rows are dropped before `plan` is sampled)."""
    n = plan.sampling.num_batch_rows
    if before is not None and len(before) == n:
        plan.token_ids[:n] = tokens
        return
    by_seq = {} if before is None else {id(seq): t for seq, t in zip(before.seqs, tokens)}
    for r, seq in enumerate(plan.sampling.seqs[:n]):
        if id(seq) in by_seq:
            plan.token_ids[r] = by_seq[id(seq)]


def drop_finished_rows(plan: StepPlan) -> int:
    """Removes the sample rows of sequences that ended after `plan` was scheduled (their tokens
    would follow a stop, or belong to an aborted request); returns how many. The rows left go
    through the row-by-row stop checks (the batch's shortcut assumes every batch row is present)."""
    rows = plan.sampling
    if rows is None:
        return 0
    keep = [r for r, seq in enumerate(rows.seqs) if not seq.status.is_finished]
    if len(keep) == len(rows):
        return 0
    plan.sampling = subset(rows, keep) if keep else None
    return len(rows) - len(keep)
