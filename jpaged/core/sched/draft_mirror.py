"""When a draft-model engine runs its draft beside the target, and how the draft's cache catches up.

A draft model (speculative.method draft_model, jpaged.executors.drafting) keeps its own K/V in a
pool indexed by the target's block tables, so that its draft loop can start from any sequence's
last token. Mirroring every step the target runs keeps that pool complete, but above
`disable_by_batch_size` no step drafts, and the mirrored steps would only cost time (5-10% at
batch 8 on the asset models, results/spec_decode_vllm.json). So:

- a step planned while speculation is off at the running set's size is not mirrored
  (`skip`: `StepPlan.draft_mirror` False), and each of its sequences records where its draft K/V
  stops (`Sequence.draft_lag`: the tokens computed before its first unmirrored step);
- a step planned while speculation may run is mirrored, and the lagging sequences among its own
  catch up first (`CatchUp`): `StepPlan.draft_catchup`, a draft-only plan of their missing tokens (positions
  draft_lag .. the step's first, with their tokens, slots and tables, like prompt chunks), which the
  executor runs on the draft before anything else of the step. At most `budget` tokens a step (the
  token budget: a catch-up runs at a model-step shape the draft has compiled); a sequence whose
  catch-up does not fit continues it in its next mirrored step and drafts nothing until done.

Drafts only decide how many tokens a verify step may accept, never which: a draft computed over
stale K/V is verified like any other. So a gap costs speed, not correctness; the one gap left is
prefix-cache blocks computed during unmirrored steps and then shared by a new sequence, whose draft
K/V is not rebuilt (their drafts are poorer). Preemption by recompute drops the lag with the
blocks (`Scheduler._release`). Pure Python + numpy.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from jpaged.core.padding import arange, seq_bucket, token_bucket
from jpaged.core.step_plan import StepPlan

if TYPE_CHECKING:
    from jpaged.core.kv.kv_manager import KVCacheManager
    from jpaged.core.sequence import Sequence


def first_positions(plan: StepPlan) -> list[int]:
    """Each sequence's first position in `plan`: the tokens it had computed before the step."""
    return plan.positions[plan.query_start_loc[: plan.num_seqs]].tolist()


def skip(plan: StepPlan) -> None:
    """Marks `plan` as run without the draft and records, for each of its sequences not lagging
    yet, the tokens it had computed before this step (the position of its first row)."""
    plan.draft_mirror = False
    for seq, first in zip(plan.seqs, first_positions(plan)):
        if seq.draft_lag is None:
            seq.draft_lag = first


@dataclasses.dataclass
class CatchUp:
    """A step's catch-up of the draft K/V of its lagging sequences, decided but not yet applied."""

    seqs: list[Sequence]
    lags: list[int | None]  # each sequence's draft_lag once the step has run
    spans: list[tuple[Sequence, int, int]]  # (sequence, start, end): positions the draft computes

    @classmethod
    def of(cls, seqs: list[Sequence], firsts: list[int], budget: int) -> CatchUp:
        """The catch-up of `seqs` (`firsts[i]`: tokens computed before this step) in at most
        `budget` tokens, in order; a sequence it covers to its step lags no more."""
        lags, spans = [], []
        for seq, first in zip(seqs, firsts):
            lag = seq.draft_lag
            if lag is None or lag >= first:  # (lag >= first: nothing missing, the step is mirrored)
                lags.append(None)
                continue
            end = min(first, lag + budget)
            if end > lag:
                spans.append((seq, lag, end))
                budget -= end - lag
            lags.append(None if end == first else end)
        return cls(list(seqs), lags, spans)

    def lagging(self) -> list[bool]:
        """Per sequence: whether its draft K/V still misses tokens after this step's catch-up (it
        must not draft in this step)."""
        return [lag is not None for lag in self.lags]

    def apply(self, kv: KVCacheManager) -> StepPlan | None:
        """Records the sequences' new lags and returns the draft-only plan of the spans (None when
        there are none)."""
        for seq, lag in zip(self.seqs, self.lags):
            seq.draft_lag = lag
        if not self.spans:
            return None
        return catchup_plan(kv, [(seq, kv.rows.row_of(seq.seq_id), start, end) for seq, start, end in self.spans])


def catchup_plan(kv: KVCacheManager, work: list[tuple[Sequence, int, int, int]]) -> StepPlan:
    """A plan, without sampling, in which each (sequence, block-table row, start, end) of `work`
    computes its tokens at positions [start, end) into the slots its table gives them."""
    store, block_size = kv.rows, kv.block_size
    n, total = len(work), sum(end - start for _, _, start, end in work)
    size_s = seq_bucket(n)
    token_ids, positions, slot_mapping = np.zeros((3, token_bucket(total)), np.int32)
    query_start_loc = np.full(size_s + 1, total, np.int32)
    context_lens = np.zeros(size_s, np.int32)
    block_tables = np.zeros((size_s, store.max_blocks_per_seq), np.int32)
    every_position = arange(store.max_blocks_per_seq * block_size)
    row_start = 0
    for i, (seq, row, start, end) in enumerate(work):
        query_start_loc[i] = row_start
        stop = row_start + end - start
        table = store.block_tables[row]
        token_ids[row_start: stop] = seq.token_ids[start: end]
        positions[row_start: stop] = span = every_position[start: end]
        slot_mapping[row_start: stop] = table[span // block_size] * block_size + span % block_size
        context_lens[i] = end
        block_tables[i] = table
        row_start = stop
    return StepPlan(num_seqs=n, num_tokens=total, max_query_len=max(end - start for _, _, start, end in work),
                    token_ids=token_ids, positions=positions, slot_mapping=slot_mapping,
                    query_start_loc=query_start_loc, context_lens=context_lens, block_tables=block_tables,
                    logits_indices=np.zeros(size_s, np.int32), num_prefill_tokens=total)
