"""StepPlan: everything one engine step hands to the executor — the host/device seam.

The scheduler decides *what* runs; the StepPlan says it in numpy arrays padded to a few bucket
sizes, so that the jitted model step sees a handful of shapes and steady-state serving does not
recompile. Pure numpy: no jax import here.

Padding conventions (the kernels rely on them):
- Padded tokens carry token id 0, position 0 and a slot inside reserved block 0, so their K/V
  writes land in a block no live sequence ever owns.
- Padded sequences have context length 0, an empty query range and a block table row of zeros.
"""

from __future__ import annotations

import dataclasses

import numpy as np

_EMPTY_PAIRS = np.zeros((0, 2), dtype=np.int32)


def bucket(n: int, minimum: int = 8) -> int:
    """Smallest power of two >= max(n, minimum): the padded size of a dimension of length n."""
    size = minimum
    while size < n:
        size *= 2
    return size


@dataclasses.dataclass
class StepPlan:
    """One step's batch as padded numpy arrays plus the block operations to apply before it.

    T = padded token count, S = padded sequence count, M = padded blocks per sequence.
    """

    is_prefill: bool  # prefill batch (prompt tokens) or decode batch (one token per sequence)
    num_seqs: int  # real sequences in the batch (rows [0, num_seqs) of the per-sequence arrays)
    num_tokens: int  # real tokens in the batch (rows [0, num_tokens) of the per-token arrays)
    token_ids: np.ndarray  # i32[T] input token of each row
    positions: np.ndarray  # i32[T] position of each token in its sequence
    slot_mapping: np.ndarray  # i32[T] KV slot each token's K/V is written to (padding -> block 0)
    query_start_loc: np.ndarray  # i32[S + 1] sequence s owns token rows [qsl[s], qsl[s+1])
    context_lens: np.ndarray  # i32[S] tokens of context after this step's writes (0 = padding)
    block_tables: np.ndarray  # i32[S, M] physical block of each logical block (padding -> 0)
    logits_indices: np.ndarray  # i32[S] token row whose logits are sampled for each sequence
    copy_pairs: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_PAIRS)  # i32[P, 2] (src, dst) device blocks, copy-on-write
    swap_in_pairs: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_PAIRS)  # i32[P, 2] (host, device) blocks to copy in
    swap_out_pairs: np.ndarray = dataclasses.field(default_factory=lambda: _EMPTY_PAIRS)  # i32[P, 2] (device, host) blocks to copy out

    @property
    def padded_shape(self) -> tuple[int, int, int]:
        """(T, S, M): the bucketed shape the jitted step is compiled for."""
        return (len(self.token_ids), len(self.context_lens), self.block_tables.shape[1])

    @property
    def is_empty(self) -> bool:
        """True when no sequence runs this step (only block operations, if any)."""
        return self.num_seqs == 0


def pairs_array(pairs: list[tuple[int, int]]) -> np.ndarray:
    """An i32[P, 2] array of block pairs (an empty list gives shape [0, 2])."""
    if not pairs:
        return _EMPTY_PAIRS
    return np.asarray(pairs, dtype=np.int32).reshape(-1, 2)
