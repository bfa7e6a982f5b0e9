"""The host/device contract of one step: StepPlan in, ModelOutput out.

The scheduler decides *what* runs; the StepPlan says it in numpy arrays padded to a few bucket
sizes (`jpaged.core.padding`), so that the jitted model step sees a handful of shapes and steady
serving does not recompile. One plan describes any mix of prompt chunks and decodes: sequence s
computes its context's last q_s tokens (q_s = 1 for a decode, more for a prompt chunk);
`max_query_len == 1` is the decode fast path. The executor applies the plan's block operations,
runs the arrays through the model, samples its SampleRows and answers with a ModelOutput: a token
per sample row, never logits. The scheduler fills plans by `jpaged.core.sched.plan_builder`; a
step of block operations alone is `StepPlan.block_ops_only`.

Padding conventions (the kernels rely on them):
- Padded tokens carry token id 0, position 0 and a slot inside reserved block 0, so their K/V
  writes land in a block no live sequence ever owns.
- Padded sequences have context length 0, an empty query range and a block table row of zeros.

Pure numpy: no jax import.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, ClassVar
from typing import Sequence as Seq

import numpy as np

from jpaged.core.padding import bucket, ragged_shape
from jpaged.core.sampling_controls import SamplingControls, build_controls

if TYPE_CHECKING:
    from jpaged.core.sequence import Sequence, SequenceGroup

_EMPTY_PAIRS = np.zeros((0, 2), dtype=np.int32)
_EMPTY_PAIRS.flags.writeable = False


def pairs_array(pairs: Seq[tuple[int, int]]) -> np.ndarray:
    """An i32[P, 2] array of block pairs (an empty list gives shape [0, 2])."""
    if not len(pairs):
        return _EMPTY_PAIRS
    return np.asarray(pairs, dtype=np.int32).reshape(-1, 2)


@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling settings as arrays; row r samples from logits row `logits_rows[r]`."""

    logits_rows: np.ndarray  # i32[R] which logits row each sample reads (a prompt row repeats for n > 1)
    temperature: np.ndarray  # f32[R] 0 = greedy
    top_k: np.ndarray  # i32[R] 0 = off
    top_p: np.ndarray  # f32[R] 1 = off
    seed: np.ndarray  # u32[R] the request's seed
    stream: np.ndarray  # i32[R] the request's stream base + the sample's index in its group
    position: np.ndarray  # i32[R] position of the token being sampled
    num_top: int = 0  # also return the top `num_top` log-probabilities per row (beams; SamplingParams.logprobs)
    min_p: np.ndarray | None = None  # f32[R] 0 = off (None: off for every row)
    controls: SamplingControls | None = None  # penalties, logit_bias, banned and allowed tokens (None: no row has any)


@dataclasses.dataclass
class SampleRows:
    """Which sequences sample a token after the step, and from which logits row.

    Usually one row per sequence that computed its last token. A fresh prompt of a request with
    n > 1 samples gets n rows reading its logits (rows with index > 0 become forks), and beam
    rows also ask for their top candidates.
    """

    seqs: list[Sequence]  # [R] the sequence each row extends (a fresh prompt's, for all its n samples)
    logits_rows: np.ndarray  # i32[R] the batch row whose logits it reads
    indices: list[int] | None  # [R] sample index in the group; None: each sequence's own index
    num_top: int  # top candidates per row (2 x the widest beam); 0 without beams
    is_plain: bool  # one row per sequence, no beams, no forks: tokens are appended as they come
    first_token_groups: list  # requests whose first output token this step samples
    # Set when the first `num_batch_rows` rows are the running batch's decodes, in its order, and
    # their ends are known but for stop tokens: such a row ends by sampling one of `stop_tokens`,
    # or by reaching its length limit exactly when it is in `length_stops` (the stop checks then
    # test the batch at once; the batch itself comes with the SchedulerOutput). The other rows
    # (prompts, in a mixed step) are checked one by one.
    stop_tokens: frozenset[int] | None = None
    token_lists: list[list[int]] | None = None  # [B] each batch row's `seq.token_ids`
    length_stops: list[int] = dataclasses.field(default_factory=list)  # batch rows this step's token brings to their length limit
    num_batch_rows: int = 0  # B
    # A verify step (jpaged.core.sched.speculation): a sequence's rows are consecutive, row j
    # sampling position len(seq) + j (`spec_offsets[r]` = j) and checking the draft
    # `spec_drafts[r]` (-1 on its last row, which only samples; all -1 when the executor's draft
    # model drafts, `ModelOutput.drafts`). None: one row per position as usual.
    spec_offsets: list[int] | None = None
    spec_drafts: list[int] | None = None

    def __len__(self) -> int:
        return len(self.seqs)

    @functools.cached_property
    def batch(self) -> SamplingBatch:
        """The rows' sampling settings as arrays (built on first use: the simulator never asks)."""
        seqs = self.seqs
        params = [s.group.sampling_params for s in seqs]
        indices = self.indices if self.indices is not None else [s.index for s in seqs]
        num_logprobs = max((p.logprobs or 0 for p in params), default=0)
        min_p = [p.min_p for p in params]
        return SamplingBatch(
            logits_rows=self.logits_rows.astype(np.int32),
            temperature=np.array([p.temperature for p in params], np.float32),
            top_k=np.array([p.top_k for p in params], np.int32),
            top_p=np.array([p.top_p for p in params], np.float32),
            seed=np.array([s.group.seed for s in seqs], np.uint32),
            stream=np.array([(s.group.stream_base + i) & 0x7FFFFFFF for s, i in zip(seqs, indices)], np.int32),
            position=np.array([len(s) for s in seqs], np.int32) + (0 if self.spec_offsets is None else
                                                                   np.array(self.spec_offsets, np.int32)),
            num_top=max(self.num_top, num_logprobs),
            min_p=np.array(min_p, np.float32) if any(min_p) else None,
            controls=build_controls(seqs))


@dataclasses.dataclass
class PromptRows:
    """Token rows whose logits give prompt log-probabilities (SamplingParams.prompt_logprobs).

    The row of prompt position p predicts the prompt's token at p + 1; only requests that asked, and
    only positions they have no log-probabilities for yet, have rows (a recomputed prompt reports once).
    """

    token_rows: np.ndarray  # i32[P] rows of the plan's per-token arrays, request after request
    targets: np.ndarray  # i32[P] the prompt token each row predicts (its log-probability and rank come back)
    num_top: int  # top candidates per row: the most any of the requests asked for (0: the target's only)
    groups: list[tuple[SequenceGroup, int, int]]  # (request, its first prompt position reported, count)


@dataclasses.dataclass
class StepPlan:
    """One step's batch as padded numpy arrays plus the block operations to apply before it.

    T = padded token count, S = padded sequence count, M = padded blocks per sequence.
    """

    # The arrays the device reads, all int32 (the model runner's inputs).
    DEVICE_ARRAYS: ClassVar[tuple[str, ...]] = ("token_ids", "positions", "slot_mapping", "block_tables",
                                                "context_lens", "query_start_loc", "logits_indices")

    num_seqs: int  # real sequences in the batch (rows [0, num_seqs) of the per-sequence arrays)
    num_tokens: int  # real tokens in the batch (rows [0, num_tokens) of the per-token arrays)
    max_query_len: int  # most tokens one sequence computes (1: a decode-only step, T == S)
    token_ids: np.ndarray  # i32[T] input token of each row
    positions: np.ndarray  # i32[T] position of each token in its sequence
    slot_mapping: np.ndarray  # i32[T] KV slot each token's K/V is written to (padding -> block 0)
    query_start_loc: np.ndarray  # i32[S + 1] sequence s owns token rows [qsl[s], qsl[s+1])
    context_lens: np.ndarray  # i32[S] tokens of context after this step's writes (0 = padding)
    block_tables: np.ndarray  # i32[S, M] physical block of each logical block (padding -> 0)
    logits_indices: np.ndarray  # i32[S] token row whose logits each sequence may sample from
    sampling: SampleRows | None = None  # who samples after the step (None: nobody)
    num_prefill_tokens: int = 0  # real tokens that are prompt chunks (or recomputed history), not decodes
    copy_pairs: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_PAIRS)  # i32[P, 2] (src, dst) device blocks, copy-on-write
    swap_in_pairs: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_PAIRS)  # i32[P, 2] (host, device) blocks to copy in
    swap_out_pairs: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_PAIRS)  # i32[P, 2] (device, host) blocks to copy out
    # i32[P, 2] (device, host): prefix-cache blocks evicted to the host tier, copied out first of all
    # (before the swap-outs: a swap-out may reuse a host block the tier gave back in this step)
    offload_pairs: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_PAIRS)
    seqs: list[Sequence] = dataclasses.field(default_factory=list)  # the batch's sequences, row by row
    prompt_rows: PromptRows | None = None  # rows whose logits also come back as prompt log-probabilities
    # With a draft model (jpaged.core.sched.draft_mirror): whether the draft runs this plan too, and
    # a draft-only plan run before it that fills the draft K/V its lagging sequences miss.
    draft_mirror: bool = True
    draft_catchup: StepPlan | None = None

    @classmethod
    def block_ops_only(cls, *, copy: Seq[tuple[int, int]] = (), swap_in: Seq[tuple[int, int]] = (),
                       swap_out: Seq[tuple[int, int]] = (), offload: Seq[tuple[int, int]] = ()) -> StepPlan:
        """A plan that runs no sequence, only block copies: copy-on-write pairs (src, dst), swap-in
        pairs (host, device), swap-out and offload pairs (device, host). Its arrays have the smallest
        bucket shape."""
        size = bucket(0)
        zeros = np.zeros(size, np.int32)
        return cls(num_seqs=0, num_tokens=0, max_query_len=0, token_ids=zeros, positions=zeros, slot_mapping=zeros,
                   query_start_loc=np.zeros(size + 1, np.int32), context_lens=zeros,
                   block_tables=np.zeros((size, 1), np.int32), logits_indices=zeros, copy_pairs=pairs_array(copy),
                   swap_in_pairs=pairs_array(swap_in), swap_out_pairs=pairs_array(swap_out),
                   offload_pairs=pairs_array(offload))

    def device_arrays(self) -> dict[str, np.ndarray]:
        """The arrays the device reads, by name (`DEVICE_ARRAYS`)."""
        return {name: getattr(self, name) for name in self.DEVICE_ARRAYS}

    @property
    def padded_shape(self) -> tuple[int, int, int]:
        """(T, S, M): the bucketed shape the jitted step is compiled for."""
        return (len(self.token_ids), len(self.context_lens), self.block_tables.shape[1])

    def to_ragged(self, max_num_seqs: int, max_blocks_per_seq: int) -> StepPlan:
        """This plan at the ragged shape of its T (`padding.ragged_shape`): the per-sequence arrays
        padded, or cut, to that shape's S and the block tables widened to the full width, so one
        model program serves every plan of T tokens. Rows cut are padding (a plan
        never has more real sequences than tokens or than max_num_seqs); rows added are padding
        sequences (no context, an empty query range at the end, logits row 0). `self` when it
        already has that shape."""
        num_tokens, num_seqs, width = ragged_shape(len(self.token_ids), max_num_seqs, max_blocks_per_seq)
        if self.padded_shape == (num_tokens, num_seqs, width):
            return self
        if self.num_seqs > num_seqs or self.block_tables.shape[1] > width:
            raise ValueError(f"plan of {self.num_seqs} sequences and {self.block_tables.shape[1]} table columns "
                             f"does not fit the ragged shape (T={num_tokens}, S={num_seqs}, M={width})")
        have = min(num_seqs, len(self.context_lens))
        context_lens = np.zeros(num_seqs, np.int32)
        context_lens[:have] = self.context_lens[:have]
        query_start_loc = np.full(num_seqs + 1, self.query_start_loc[self.num_seqs], np.int32)
        query_start_loc[: have + 1] = self.query_start_loc[: have + 1]
        logits_indices = np.zeros(num_seqs, np.int32)
        logits_indices[:have] = self.logits_indices[:have]
        block_tables = np.zeros((num_seqs, width), np.int32)
        block_tables[:have, : self.block_tables.shape[1]] = self.block_tables[:have]
        return dataclasses.replace(self, context_lens=context_lens, query_start_loc=query_start_loc,
                                   logits_indices=logits_indices, block_tables=block_tables)

    @property
    def has_block_ops(self) -> bool:
        """True when the step copies, swaps or offloads blocks."""
        return bool(len(self.copy_pairs) or len(self.swap_in_pairs) or len(self.swap_out_pairs)
                    or len(self.offload_pairs))

    @property
    def query_lens(self) -> np.ndarray:
        """i32[num_seqs] tokens each real sequence computes this step."""
        return np.diff(self.query_start_loc[: self.num_seqs + 1])


@dataclasses.dataclass
class ModelOutput:
    """What one executed step returns to the engine core: a token per sample row, not logits."""

    token_ids: np.ndarray | list[int]  # [R] the token sampled for each row of plan.sampling
    logprobs: np.ndarray | None  # f32[R] log-probability of each sampled token; None without a model
    top_ids: np.ndarray | None  # i32[R, K] most likely tokens per row, best first (beams, logprobs), else None
    top_logprobs: np.ndarray | None  # f32[R, K] their log-probabilities
    duration: float  # seconds the step took: wall time (jax) or cost-model time (sim)
    prompt_logprobs: PromptLogprobs | None = None  # for plan.prompt_rows; None when none or without a model
    # i32[R] a verify step's drafts as the executor's draft model made them: the draft each sample
    # row checked (-1 on a sequence's last row); None: the plan's own `spec_drafts`.
    drafts: np.ndarray | None = None


@dataclasses.dataclass
class PromptLogprobs:
    """Log-probabilities at a step's PromptRows, as host arrays (P rows, K = their num_top)."""

    token_logprobs: np.ndarray  # f32[P] log-probability of each row's target token
    ranks: np.ndarray  # i32[P] its rank: how many tokens are at least as likely (1 = the likeliest)
    top_ids: np.ndarray  # i32[P, K] most likely tokens, best first
    top_logprobs: np.ndarray  # f32[P, K] their log-probabilities
