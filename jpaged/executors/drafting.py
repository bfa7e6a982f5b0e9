"""The draft model of speculative decoding (`speculative.method: draft_model`), executor side.

The scheduler's verify plan of a draft-model engine carries placeholder drafts
(jpaged.core.sched.speculation.PLACEHOLDER): sequence s computes its last token and `room_s`
drafts, k_s = room_s <= K = num_speculative_tokens. The executor fills them in just before the
target runs the plan: one program (`ModelRunner.draft`) runs K + 1 greedy decode steps of the
draft model, step j feeding each sequence the token at its position L - 1 + j (j = 0: its last
token, then the draft step j - 1 chose) and writing that token's K/V into the draft's own pool at
the plan's slot of that position. Steps 0..k_s - 1 give d_1..d_k_s; step k_s writes d_k_s's K/V,
so that the draft's KV covers every token the verify step can accept. A sequence past its k_s + 1
steps computes a padded row (slot in reserved block 0, one token of context).

The draft's pool has the target's block count and block size and is indexed by the same block
tables and slots: no second block manager. Every other plan the target runs is run by the draft
too (`StepPlan.draft_mirror`), but for those planned while speculation is off at the batch's size,
whose tokens a later plan's `draft_catchup` gives the draft before it drafts from them
(jpaged.core.sched.draft_mirror); every block operation (copies, swaps, the host tier's offloads)
moves its blocks as well (`JaxExecutor.launch`). Slots a verify step gives back hold rejected
drafts' K/V in both pools and are overwritten before they are read again.
Pure numpy, but for loading the draft.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jpaged.config import EngineConfig, ModelConfig
from jpaged.config.presets import ModelSpec
from jpaged.core.step_plan import SampleRows, StepPlan
from jpaged.models import decoder


def load_draft(config: EngineConfig, target: ModelSpec) -> tuple[ModelSpec, decoder.Params]:
    """The draft model `speculative.model` (a local Hugging Face directory) in the target's dtype:
    (spec, params). ValueError naming `speculative.model` when it cannot be the target's draft."""
    # Imported here: the checkpoint module imports orbax, whose import configures the root logger
    # (absl), and the warm-up grid imports this module before `jpaged serve` sets its log level.
    from jpaged.models.checkpoint import load_params

    model = config.model
    if model.tensor_parallel_size > 1:
        raise ValueError(f"speculative.model: a draft model runs on one device; model.tensor_parallel_size is "
                         f"{model.tensor_parallel_size}")
    directory = config.speculative.model
    try:
        spec, params = load_params(ModelConfig(name="draft", dtype=model.dtype, checkpoint=directory,
                                               attention_backend=model.attention_backend))
    except (OSError, ValueError) as exc:
        raise ValueError(f"speculative.model: cannot load the draft model {directory!r}: {exc}") from None
    if spec.vocab_size != target.vocab_size:
        raise ValueError(f"speculative.model: the draft's vocabulary ({spec.vocab_size} tokens, {directory}) must "
                         f"be the target's ({target.vocab_size})")
    return spec, params


def draft_loop_size(num_seqs: int) -> int:
    """S of the draft loop of a verify step of `num_seqs` sequences: the power of two at or above
    it. Unlike a model step's S (at least 8), batch 1 runs 1 row: every row of the loop's K + 1
    steps pays the draft's LM head, and at batch 1 a loop of 8 rows cost 1.16 ms against 0.79 ms
    for 1 row (5 steps of assets/stdlib-draft-lm, Sapphire Rapids, 2 cores)."""
    return 1 << (num_seqs - 1).bit_length()


def draft_loop_sizes(config: EngineConfig) -> list[int]:
    """Every padded sequence count S of a draft loop under `config` (one program each): a verify
    step has at most max_num_seqs // 2 sequences (each samples k + 1 >= 2 rows), fewer than
    `disable_by_batch_size`, and two tokens each within the token budget."""
    sched, spec = config.scheduler, config.speculative
    most = min(sched.max_num_seqs, sched.max_num_batched_tokens) // 2
    if spec.disable_by_batch_size is not None:
        most = min(most, spec.disable_by_batch_size - 1)
    return sorted({draft_loop_size(n) for n in range(1, most + 1)})


@dataclasses.dataclass
class DraftInputs:
    """The draft loop's arrays for one verify plan of n sequences, padded to S rows; K + 1 steps."""

    first_tokens: np.ndarray  # i32[S] each sequence's last token (step 0's input)
    positions: np.ndarray  # i32[K + 1, S] position step j computes (0 on a padded row)
    slot_mapping: np.ndarray  # i32[K + 1, S] its slot (0, in reserved block 0, on a padded row)
    context_lens: np.ndarray  # i32[K + 1, S] context after step j's write (1 on a padded row)
    block_tables: np.ndarray  # i32[S, M] the plan's block tables (zeros on padded sequences)
    num_steps: int  # steps that compute anything: the longest sequence's 1 + k_s
    draft_rows: np.ndarray  # i32[D] token rows of the plan that take a draft
    draft_steps: np.ndarray  # i32[D] the step whose argmax each takes
    draft_seqs: np.ndarray  # i32[D] and its sequence


def draft_inputs(plan: StepPlan, num_speculative_tokens: int, max_blocks_per_seq: int) -> DraftInputs:
    """The draft loop of verify plan `plan`: sequence s's step j (j <= k_s) computes its token row
    query_start_loc[s] + j at that row's position and slot; its draft d_j (token row
    query_start_loc[s] + j, j >= 1) is step j - 1's argmax."""
    n = plan.num_seqs
    size = draft_loop_size(n)
    starts = plan.query_start_loc[:n]  # i32[n]
    counts = plan.query_start_loc[1: n + 1] - starts  # i32[n] 1 + k_s
    steps = np.arange(num_speculative_tokens + 1, dtype=np.int32)[:, None]  # [K + 1, 1]
    active = steps < counts  # bool[K + 1, n]
    rows = np.where(active, starts + steps, 0)  # [K + 1, n] token rows (row 0 where inactive: masked below)
    positions, slot_mapping = np.zeros((2, len(steps), size), np.int32)
    context_lens = np.ones((len(steps), size), np.int32)
    positions[:, :n] = np.where(active, plan.positions[rows], 0)
    slot_mapping[:, :n] = np.where(active, plan.slot_mapping[rows], 0)
    # The verify plan's context counts all 1 + k_s tokens; step j's counts j + 1 of them. A padded
    # row still owns its token row (the loop's query ranges are fixed), so its context is that one
    # token, at slot 0 of block 0: attention over it stays finite.
    context_lens[:, :n] = np.where(active, plan.context_lens[:n] - counts + steps + 1, 1)
    first_tokens = np.zeros(size, np.int32)
    first_tokens[:n] = plan.token_ids[starts]
    block_tables = np.zeros((size, max_blocks_per_seq), np.int32)
    block_tables[:n, : plan.block_tables.shape[1]] = plan.block_tables[:n]
    draft_steps, draft_seqs = np.nonzero(active[1:])  # d_j of sequence s: step j - 1's argmax, row start + j
    return DraftInputs(first_tokens, positions, slot_mapping, context_lens, block_tables, int(counts.max()),
                       (starts[draft_seqs] + draft_steps + 1).astype(np.int32), draft_steps.astype(np.int32),
                       draft_seqs.astype(np.int32))


def with_drafts(plan: StepPlan, inputs: DraftInputs, picked: np.ndarray) -> StepPlan:
    """`plan` with its placeholder drafts replaced by the draft loop's argmaxes `picked`
    (i32[K + 1, S])."""
    token_ids = plan.token_ids.copy()
    token_ids[inputs.draft_rows] = picked[inputs.draft_steps, inputs.draft_seqs]
    return dataclasses.replace(plan, token_ids=token_ids)


def checked_drafts(rows: SampleRows, token_ids: np.ndarray) -> np.ndarray:
    """i32[R] the draft each verify sample row checked (-1 on a sequence's last row): the token of
    the plan's next token row (`token_ids`, the drafts filled in), as a verify plan's sample row r
    reads the logits of its token row and samples the position the next row holds."""
    offsets = np.asarray(rows.spec_offsets, np.int32)
    last = np.ones(len(offsets), bool)  # bool[R]: a sequence's rows are consecutive, from offset 0
    last[:-1] = offsets[1:] == 0
    following = np.minimum(rows.logits_rows + 1, len(token_ids) - 1)
    return np.where(last, -1, token_ids[following]).astype(np.int32)
