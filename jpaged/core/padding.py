"""The padding rule of step shapes: a few bucket sizes per dimension, so the jitted step compiles
once per bucket and steady serving never recompiles.

Every step is ragged: decodes and prompt chunks share one flat token batch, so the model step's
only static size is its padded token count T (`token_bucket`, two sizes per doubling). The
per-sequence arrays are padded to S, the power of two at or above T but at most max_num_seqs (a
step's sequences each compute at least one token, so never more than T; never more than the
engine runs; S is also the sampler's row count), and the block tables to
their full width M (max_model_len in blocks): `ragged_shape`, `ragged_shapes`. The kernels' work
follows the context lengths and query ranges, not S or M. The scheduler's plan builders pad S and M
less (decode cursors keep their tables at the bucket of the longest context, cheaper to edit);
`StepPlan.to_ragged` brings a plan to the ragged shape of its T. Pure Python + numpy.
"""

from __future__ import annotations

import functools

import numpy as np

@functools.lru_cache(maxsize=4096)  # (called several times a step: a lookup beats the arithmetic)
def bucket(n: int, minimum: int = 8) -> int:
    """The padded size of a dimension of length n: max(n, minimum) rounded up to a multiple of a
    quarter of the power of two below it, i.e. two sizes per doubling above 4 (8, 12, 16, 24, 32,
    48, 64, 96, ... 1,024, 1,536, 2,048). Padding then wastes at most a third (powers of two waste
    up to half) while the compiled shapes stay few, two per doubling."""
    n = max(n, minimum)
    step = 1 << max(0, (n - 1).bit_length() - 2)
    return -(-n // step) * step


def token_bucket(num_tokens: int) -> int:
    """T: the padded token count of a step computing `num_tokens` tokens, decodes and prompt chunks
    alike."""
    return bucket(num_tokens)


def seq_bucket(num_seqs: int) -> int:
    """S of a plan builder's step of `num_seqs` sequences with a prompt chunk: a power of two, at
    least 8 (`StepPlan.to_ragged` then brings it to the ragged S of the step's T)."""
    return max(8, 1 << (num_seqs - 1).bit_length())


def ragged_shape(num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int) -> tuple[int, int, int]:
    """(T, S, M) of the model step that runs a plan of `num_tokens` padded tokens: S the power of
    two at or above T, at most max_num_seqs; M the full table width. (S is also the sampler's row
    count, one program each: powers of two halve those programs against T's two sizes per
    doubling, for a few padded logits rows.)"""
    return num_tokens, min(1 << (num_tokens - 1).bit_length(), max_num_seqs), max_blocks_per_seq


def ragged_shapes(max_num_seqs: int, max_num_batched_tokens: int,
                  max_blocks_per_seq: int) -> list[tuple[int, int, int]]:
    """Every (T, S, M) of a model step under these limits: one per token bucket from a single
    decode to the step's token budget (decodes alone pad T to at least the bucket of their count,
    at most max_num_seqs <= max_num_batched_tokens)."""
    return [ragged_shape(size, max_num_seqs, max_blocks_per_seq)
            for _, size in padded_sizes(token_bucket, 1, max_num_batched_tokens)]


def table_width(num_blocks: int, max_blocks_per_seq: int) -> int:
    """M: block-table columns of a decode step whose longest row uses `num_blocks` blocks."""
    return min(bucket(num_blocks), max_blocks_per_seq)


def pair_bucket(num_pairs: int) -> int:
    """The padded length of a block operation's pair array (copy, swap in, swap out): a power of
    two, at least 4. A padded pair copies block 0 onto itself, which costs next to nothing, so the
    coarser buckets save programs, not time."""
    return max(4, 1 << (num_pairs - 1).bit_length())


def padded_sizes(pad, low: int, high: int) -> list[tuple[int, int]]:
    """(smallest n, pad(n)) for each distinct value of `pad` over n in [low, high]; `pad` is
    non-decreasing with pad(n) >= n, so the next value starts at pad(n) + 1."""
    sizes = []
    n = low
    while n <= high:
        sizes.append((n, pad(n)))
        n = sizes[-1][1] + 1
    return sizes


@functools.lru_cache(maxsize=4096)
def decode_ranges(n: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(query_start_loc i32[size + 1], logits_indices i32[size]) of a decode step of n sequences
    padded to size: sequence s owns token row s; padded sequences own none. Read-only, shared."""
    query_start_loc = np.minimum(np.arange(size + 1, dtype=np.int32), n)
    logits_indices = np.arange(size, dtype=np.int32)
    query_start_loc.flags.writeable = logits_indices.flags.writeable = False
    return query_start_loc, logits_indices


@functools.lru_cache(maxsize=8)
def arange(n: int) -> np.ndarray:
    """i32[n] 0, 1, ..., n - 1 (read-only, shared)."""
    values = np.arange(n, dtype=np.int32)
    values.flags.writeable = False
    return values


@functools.lru_cache(maxsize=32)
def zeros(n: int) -> np.ndarray:
    """i32[n] zeros (read-only, shared)."""
    values = np.zeros(n, np.int32)
    values.flags.writeable = False
    return values
