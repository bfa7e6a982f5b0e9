"""Speculative decoding priced by the cost model: the verify step, the drafting, the tokens they yield.

A speculative step of a batch of B sequences, each with k drafted tokens, is:
- drafting: nothing on the GPU for an n-gram (prompt-lookup) proposer, whose search runs on the
  host; k decode steps of a small draft model at batch B for a draft-model proposer;
- verification: one target-model step whose rows each compute k + 1 query tokens (the last
  sampled token and the k drafts) over their cached context, like a chunked prefill of k + 1
  tokens per sequence, with the LM head over all B (k + 1) rows (every position's logits are
  needed to accept or reject) and the cached context read through the paged kernel, at the
  decode rows' cost (`CostModel.step_time(..., verify=True)`): vLLM's multi-query (MQA) scorer
  (vllm-project/vllm PR #8839, 2024) and V1. vLLM's first scorer (PR #3103) used batch expansion
  instead, each sequence expanded into k + 1 single-query rows at contexts L .. L + k, which pays
  the KV reads and the host's per-sequence work k + 1 times: `batch_expansion=True` prices that
  (a decode step of B (k + 1) rows).
Per-token acceptance is modelled as i.i.d. with rate a (Leviathan et al. 2023): a sequence emits
the accepted prefix of its drafts plus one token from the target (the correction, or the bonus
after k acceptances), (1 - a^(k + 1)) / (1 - a) tokens in expectation.

Contexts follow `CostModel`'s convention (counted after the step's writes): a plain decode row has
context L; its verify row writes k + 1 tokens and ends at L + k; the draft's j-th step (j = 0..k-1)
ends at L + j. Rejected drafts are given back after the step, so a sequence holds L + k slots at its
peak. Left out: the rejection sampler's work, the draft model's catching up on the previous step's
accepted tokens (one chunk, not k steps), and any host work of the n-gram search; the host's work
per verify step is the plain step's (the cost model's per-sequence line).
"""

from __future__ import annotations

import math

import numpy as np

from jpaged.paper.sim.cost_model import CostModel


def expected_tokens(acceptance: float, k: int) -> float:
    """Expected tokens one sequence emits per step with k drafts accepted i.i.d. at rate `acceptance`.

    (1 - a^(k + 1)) / (1 - a): the accepted prefix plus the target's own token. k = 0 (no
    speculation) gives 1; a = 1 gives k + 1.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
    if acceptance == 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


class SpeculativeCostModel:
    """Step times and decode throughput of a target model with and without speculation.

    `target` prices the verify step (and the plain decode step at k = 0); `draft` prices the draft
    model's steps, or None for a proposer with no device work (n-gram). Batches are uniform: B
    sequences, all at context L (the cost model's attention is linear in the summed context, so a
    mean context prices the KV reads of a mixed batch exactly). `batch_expansion`: verify by batch
    expansion (the module docstring) rather than one multi-query row per sequence.
    """

    def __init__(self, target: CostModel, draft: CostModel | None = None, *, batch_expansion: bool = False) -> None:
        self.target, self.draft, self.batch_expansion = target, draft, batch_expansion

    def verify_time(self, batch: int, context: int, k: int) -> float:
        """Seconds of the target's step over `batch` rows of k + 1 query tokens ending at context + k.

        k = 0 is the plain decode step (one query, one LM-head row per sequence). Batch expansion:
        a decode step of batch x (k + 1) rows, sequence i's rows at contexts context .. context + k.
        """
        _check(batch, context, k)
        if self.batch_expansion:
            return self.target.decode_time(np.tile(context + np.arange(k + 1, dtype=np.int32), batch))
        q = np.full(batch, k + 1, np.int32)
        return self.target.step_time(q, np.full(batch, context + k, np.int32), verify=True)

    def draft_time(self, batch: int, context: int, k: int) -> float:
        """Seconds of drafting k tokens for `batch` sequences: k draft decode steps (0 without a draft model)."""
        _check(batch, context, k)
        if self.draft is None:
            return 0.0
        return sum(self.draft.decode_time(np.full(batch, context + j, np.int32)) for j in range(k))

    def step_time(self, batch: int, context: int, k: int) -> float:
        """Seconds of one speculative step (drafting, then verification); k = 0: a plain decode step."""
        return self.draft_time(batch, context, k) + self.verify_time(batch, context, k)

    def throughput(self, batch: int, context: int, k: int, acceptance: float) -> float:
        """Output tokens per second of a steady batch: batch x expected tokens per step / step seconds."""
        return batch * expected_tokens(acceptance, k) / self.step_time(batch, context, k)

    def crossover(self, context: int, k: int, acceptance: float, max_batch: int) -> int | None:
        """The smallest batch in 1..max_batch at which speculation's throughput is no higher than
        plain decoding's (speculation pays below it), or None where it pays at every such batch."""
        for batch in range(1, max_batch + 1):
            if self.throughput(batch, context, k, acceptance) <= self.throughput(batch, context, 0, 0.0):
                return batch
        return None


def _check(batch: int, context: int, k: int) -> None:
    if batch < 1 or context < 1 or k < 0:
        raise ValueError(f"batch and context must be >= 1 and k >= 0, got {batch}, {context}, {k}")


def pool_blocks_with_draft(num_blocks: int, target: CostModel, draft: CostModel, draft_weight_bytes: int) -> int:
    """KV blocks left when a draft model shares a target's pool of `num_blocks` blocks (per GPU).

    As vLLM does, target and draft keep the same number of blocks, each block of the target paired
    with one of the draft's; the draft (on the pool's GPU) also takes its weights out of the pool:
    floor((num_blocks x target block - draft weights) / (target block + draft block)), in bytes.
    """
    pool = num_blocks * target.block_bytes
    return max(0, math.floor((pool - draft_weight_bytes) / (target.block_bytes + draft.block_bytes)))


def max_batch(num_blocks: int, block_size: int, context: int, k: int) -> int:
    """Sequences of context `context` that fit `num_blocks` blocks while each holds k drafted slots.

    A sequence holds context + k slots at its peak plus, on average, (block_size - 1) / 2 empty
    slots of its last block (its length uniform modulo the block size).
    """
    if num_blocks < 0 or block_size < 1:
        raise ValueError(f"num_blocks must be >= 0 and block_size >= 1, got {num_blocks}, {block_size}")
    _check(1, context, k)
    return math.floor(num_blocks * block_size / (context + k + (block_size - 1) / 2))
