"""The padding rule of step shapes: a few bucket sizes per dimension, so the jitted step compiles
once per bucket and steady serving never recompiles.

A decode-only step pads its sequence count S with `bucket` (T == S) and its block-table width M to
the bucket of its longest table, never past the table's full width (max_model_len in blocks): the
decode kernels' XLA path scans every column. A step with a prompt chunk pads T with `bucket` (at
least 16), S to a power of two and M to the full width: every prefill kernel's work follows the
context lengths, not M, so one width costs nothing and keeps the compiled grid small
(`decode_shapes`, `prefill_shapes`: every (T, S, M) a config can produce). Pure Python + numpy.
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


def seq_bucket(num_seqs: int, max_query_len: int) -> int:
    """S: the padded sequence count of a step of `num_seqs` sequences whose longest query is
    `max_query_len` (1: a decode-only step, `bucket`; else a power of two, at least 8). Padded
    sequences cost a row of the LM head each (empty query ranges): a power of two wastes at most
    half of S in a step that also computes a chunk of at least 2 tokens, and halves the prefill
    grid against `bucket`."""
    if max_query_len <= 1:
        return bucket(num_seqs)
    return max(8, 1 << (num_seqs - 1).bit_length())


def table_width(num_blocks: int, max_blocks_per_seq: int) -> int:
    """M: block-table columns of a decode step whose longest row uses `num_blocks` blocks."""
    return min(bucket(num_blocks), max_blocks_per_seq)


def step_width(num_blocks: int, max_blocks_per_seq: int, max_query_len: int) -> int:
    """M of any step: `table_width` for a decode-only step (max_query_len 1), the full width
    `max_blocks_per_seq` for a step with a prompt chunk."""
    return table_width(num_blocks, max_blocks_per_seq) if max_query_len <= 1 else max_blocks_per_seq


def pair_bucket(num_pairs: int) -> int:
    """The padded length of a block operation's pair array (copy, swap in, swap out)."""
    return bucket(num_pairs, minimum=4)


def padded_sizes(pad, low: int, high: int) -> list[tuple[int, int]]:
    """(smallest n, pad(n)) for each distinct value of `pad` over n in [low, high]; `pad` is
    non-decreasing with pad(n) >= n, so the next value starts at pad(n) + 1."""
    sizes = []
    n = low
    while n <= high:
        sizes.append((n, pad(n)))
        n = sizes[-1][1] + 1
    return sizes


def decode_shapes(max_num_seqs: int, max_blocks_per_seq: int) -> list[tuple[int, int, int]]:
    """Every padded (T, S, M) of a decode-only step: 1..max_num_seqs sequences, 1..max_blocks_per_seq
    blocks in the longest table."""
    seqs = padded_sizes(bucket, 1, max_num_seqs)
    widths = padded_sizes(lambda b: table_width(b, max_blocks_per_seq), 1, max_blocks_per_seq)
    return [(s, s, m) for _, s in seqs for _, m in widths]


def prefill_shapes(max_num_seqs: int, max_num_batched_tokens: int,
                   max_blocks_per_seq: int) -> list[tuple[int, int, int]]:
    """Every padded (T, S, M) of a step with a prompt chunk: t tokens of n sequences, one of them
    computing at least 2, so 2 <= t <= max_num_batched_tokens and 1 <= n <= min(max_num_seqs, t - 1)."""
    tokens = padded_sizes(lambda t: token_bucket(t, 1, 2), 2, max_num_batched_tokens)
    seqs = padded_sizes(lambda n: seq_bucket(n, 2), 1, min(max_num_seqs, max_num_batched_tokens - 1))
    return [(size_t, size_s, max_blocks_per_seq) for first_n, size_s in seqs
            for _, size_t in tokens if size_t >= token_bucket(first_n + 1, first_n, 2)]


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
