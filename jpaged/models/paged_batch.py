"""Paged batches without the engine: step arrays for given block tables, and greedy generation.

A minimal stand-in for the block manager and scheduler, small enough to trust, used by model tests,
the tiny-model training script and demos. Arrays follow the StepPlan padding conventions (padded
tokens write into reserved block 0; padded sequences have context 0 and an all-zero table row).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from jpaged.models.kv_pool import KVPool
    from jpaged.models.runner import ModelRunner


def scattered_tables(rng: np.random.Generator, blocks_per_seq: list[int], num_blocks: int) -> list[list[int]]:
    """Distinct random physical blocks in [1, num_blocks) for each sequence (never block 0)."""
    needed = sum(blocks_per_seq)
    if needed > num_blocks - 1:
        raise ValueError(f"num_blocks: {num_blocks} leaves {num_blocks - 1} usable blocks, {needed} needed")
    ids = rng.permutation(np.arange(1, num_blocks))
    starts = np.cumsum([0] + blocks_per_seq)
    return [[int(b) for b in ids[a:b]] for a, b in zip(starts[:-1], starts[1:])]


def table_array(tables: list[list[int]], pad_seqs: int = 0, pad_blocks: int = 0) -> np.ndarray:
    """Block tables as i32[S + pad_seqs, M + pad_blocks], zero-padded (padding reads block 0)."""
    out = np.zeros((len(tables) + pad_seqs, max(len(t) for t in tables) + pad_blocks), np.int32)
    for s, table in enumerate(tables):
        out[s, :len(table)] = table
    return out


def build_step_arrays(contexts: list[list[int]], num_query: list[int], tables: list[list[int]], block_size: int,
                      *, pad_tokens: int = 0, pad_seqs: int = 0, pad_blocks: int = 0) -> dict[str, np.ndarray]:
    """Step arrays in which sequence s runs the last `num_query[s]` tokens of `contexts[s]`.

    `tables[s]` must cover the whole context. `pad_*` append padded tokens, sequences and block
    table columns, as the engine's shape buckets do.
    """
    tok, pos, slots, qsl = [], [], [], [0]
    for ctx, q, table in zip(contexts, num_query, tables):
        if not 1 <= q <= len(ctx) or len(table) * block_size < len(ctx):
            raise ValueError(f"num_query/tables: need 1 <= query ({q}) <= context ({len(ctx)}) <= "
                             f"table capacity ({len(table) * block_size})")
        for p in range(len(ctx) - q, len(ctx)):
            tok.append(ctx[p])
            pos.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        qsl.append(qsl[-1] + q)
    return {
        "token_ids": np.asarray(tok + [0] * pad_tokens, np.int32),  # [T]
        "positions": np.asarray(pos + [0] * pad_tokens, np.int32),  # [T]
        "slot_mapping": np.asarray(slots + [0] * pad_tokens, np.int32),  # [T]; padding -> block 0
        "block_tables": table_array(tables, pad_seqs, pad_blocks),  # [S, M]
        "context_lens": np.asarray([len(c) for c in contexts] + [0] * pad_seqs, np.int32),  # [S]
        "query_start_loc": np.asarray(qsl + [qsl[-1]] * pad_seqs, np.int32),  # [S + 1]
        "logits_indices": np.asarray([e - 1 for e in qsl[1:]] + [0] * pad_seqs, np.int32),  # [S]
    }


def greedy_generate(runner: ModelRunner, kv_pool: KVPool, prompts: list[list[int]], max_new_tokens: int,
                    tables: list[list[int]], *, decode_tables: list[list[int]] | None = None,
                    ) -> tuple[list[list[int]], KVPool]:
    """Greedy decoding of a batch: one prefill of all prompts, then `max_new_tokens - 1` decode steps.

    `tables[s]` must hold len(prompts[s]) + max_new_tokens - 1 tokens. `decode_tables` (default
    `tables`) lets a test read a deliberately corrupted cache during decode. Returns the generated
    tokens and the updated (donated-through) pool.
    """
    bs = runner.block_size
    arrays = build_step_arrays(prompts, [len(p) for p in prompts], tables, bs)
    logits, kv_pool = runner.prefill(kv_pool, arrays)
    contexts = [list(p) + [int(t)] for p, t in zip(prompts, np.asarray(logits).argmax(-1))]
    # Tables are allocated up front for the whole generation, so every decode step has one shape.
    read_tables = table_array(decode_tables or tables)
    for _ in range(max_new_tokens - 1):
        arrays = build_step_arrays(contexts, [1] * len(contexts), tables, bs)
        arrays["block_tables"] = read_tables
        logits, kv_pool = runner.decode(kv_pool, arrays)
        for ctx, t in zip(contexts, np.asarray(logits).argmax(-1)):
            ctx.append(int(t))
    return [ctx[len(p):] for ctx, p in zip(contexts, prompts)], kv_pool

