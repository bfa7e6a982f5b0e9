"""The padding rule of step shapes: a few bucket sizes per dimension, so the jitted step compiles
once per bucket and steady serving never recompiles.

A step's token count T, sequence count S and block-table width M are each padded with `bucket`
(a decode-only step has T == S; a step with a prompt chunk pads T separately, at least 16), and M
never exceeds the table's full width (max_model_len in blocks). Pure Python + numpy.
"""

from __future__ import annotations

import functools

import numpy as np

MIN_PREFILL_TOKENS = 16  # the smallest padded token count of a step that runs a prompt chunk


@functools.lru_cache(maxsize=4096)  # (called several times a step: a lookup beats the arithmetic)
def bucket(n: int, minimum: int = 8) -> int:
    """The padded size of a dimension of length n: max(n, minimum) rounded up to a multiple of a
    quarter of the power of two below it, i.e. two sizes per doubling above 4 (8, 12, 16, 24, 32,
    48, 64, 96, ... 1,024, 1,536, 2,048). Padding then wastes at most a third (powers of two waste
    up to half) while the compiled shapes stay few, two per doubling."""
    n = max(n, minimum)
    step = 1 << max(0, (n - 1).bit_length() - 2)
    return -(-n // step) * step


def token_bucket(num_tokens: int, num_seqs: int, max_query_len: int) -> int:
    """T: the padded token count of a step of `num_seqs` sequences computing `num_tokens` tokens,
    the longest query `max_query_len` (1: a decode-only step, T == S)."""
    return bucket(num_seqs) if max_query_len <= 1 else bucket(num_tokens, minimum=MIN_PREFILL_TOKENS)


def table_width(num_blocks: int, max_blocks_per_seq: int) -> int:
    """M: block-table columns of a step whose longest row uses `num_blocks` blocks."""
    return min(bucket(num_blocks), max_blocks_per_seq)


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
