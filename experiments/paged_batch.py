"""Paged batches without the engine: plans from explicit contexts and block tables, scattered
block tables, and greedy generation over them.

A minimal stand-in for the block manager and scheduler, small enough to trust, used by the model
tests, benchmarks, the executor profile and the tiny-model training script. The scheduler's hot
path builds its plans itself (`jpaged.core.sched.plan_builder`); the plans here are padded as it pads.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING
from typing import Sequence as Seq

import numpy as np

from jpaged.core.padding import bucket, token_bucket
from jpaged.core.step_plan import StepPlan

if TYPE_CHECKING:
    from jpaged.models.kv_pool import KVPool
    from jpaged.models.runner import ModelRunner


def plan_from_contexts(contexts: Seq[Seq[int]], num_query: Seq[int], tables: Seq[Seq[int]], block_size: int,
                       *, shape: tuple[int, int, int] | None = None) -> StepPlan:
    """A plan in which sequence s computes the last `num_query[s]` tokens of `contexts[s]`, its K/V
    written through and read from `tables[s]` (physical block ids covering its whole context);
    nobody samples. `shape` (T, S, M) pads to exact sizes; None pads as the scheduler does
    (`jpaged.core.padding`: T and S to their buckets, M to the bucket of the longest table, as under
    a max_model_len that does not cap it)."""
    n = len(contexts)
    if n == 0 or len(num_query) != n or len(tables) != n:
        raise ValueError(f"contexts, num_query, tables: need as many of each, at least one "
                         f"(got {n}, {len(num_query)}, {len(tables)})")
    for s, (ctx, q, table) in enumerate(zip(contexts, num_query, tables)):
        if not 1 <= q <= len(ctx) or len(table) * block_size < len(ctx):
            raise ValueError(f"num_query[{s}] / tables[{s}]: need 1 <= query ({q}) <= context ({len(ctx)}) "
                             f"<= table capacity ({len(table) * block_size})")
    total, longest, width = sum(num_query), max(num_query), max(len(t) for t in tables)
    if shape is None:
        shape = (token_bucket(total), bucket(n), bucket(width))
    size_t, size_s, size_m = shape
    if size_t < total or size_s < n or size_m < width:
        raise ValueError(f"shape: (T, S, M) = {shape} must hold {total} tokens, {n} sequences and {width} "
                         f"blocks per sequence")
    token_ids, positions, slot_mapping = np.zeros((3, size_t), np.int32)
    block_tables = np.zeros((size_s, size_m), np.int32)
    context_lens = np.zeros(size_s, np.int32)
    query_start_loc = np.full(size_s + 1, total, np.int32)
    query_start_loc[0] = 0
    start = 0
    for s, (ctx, q, table) in enumerate(zip(contexts, num_query, tables)):
        block_tables[s, : len(table)] = table
        context_lens[s] = len(ctx)
        stop = start + q
        pos = np.arange(len(ctx) - q, len(ctx), dtype=np.int32)
        token_ids[start:stop] = ctx[len(ctx) - q:]
        positions[start:stop] = pos
        slot_mapping[start:stop] = block_tables[s, pos // block_size] * block_size + pos % block_size
        query_start_loc[s + 1] = start = stop
    logits_indices = np.zeros(size_s, np.int32)
    logits_indices[:n] = query_start_loc[1: n + 1] - 1
    return StepPlan(num_seqs=n, num_tokens=total, max_query_len=longest, token_ids=token_ids, positions=positions,
                    slot_mapping=slot_mapping, query_start_loc=query_start_loc, context_lens=context_lens,
                    block_tables=block_tables, logits_indices=logits_indices,
                    num_prefill_tokens=sum(q for q in num_query if q > 1))


def scattered_tables(rng: np.random.Generator, blocks_per_seq: list[int], num_blocks: int) -> list[list[int]]:
    """Distinct random physical blocks in [1, num_blocks) for each sequence (never block 0)."""
    needed = sum(blocks_per_seq)
    if needed > num_blocks - 1:
        raise ValueError(f"num_blocks: {num_blocks} leaves {num_blocks - 1} usable blocks, {needed} needed")
    ids = rng.permutation(np.arange(1, num_blocks))
    starts = np.cumsum([0] + blocks_per_seq)
    return [[int(b) for b in ids[a:b]] for a, b in zip(starts[:-1], starts[1:])]


def greedy_generate(runner: ModelRunner, kv_pool: KVPool, prompts: list[list[int]], max_new_tokens: int,
                    tables: list[list[int]], *, decode_tables: list[list[int]] | None = None,
                    ) -> tuple[list[list[int]], KVPool]:
    """Greedy decoding of a batch: one prefill of all prompts, then `max_new_tokens - 1` decode steps.

    `tables[s]` must hold len(prompts[s]) + max_new_tokens - 1 tokens. `decode_tables` (default
    `tables`) lets a test read a deliberately corrupted cache during decode (writes still go through
    `tables`). Returns the generated tokens and the updated (donated-through) pool.
    """
    bs, n = runner.block_size, len(prompts)
    logits, kv_pool = runner.step(kv_pool, plan_from_contexts(prompts, [len(p) for p in prompts], tables, bs))
    contexts = [list(p) + [int(t)] for p, t in zip(prompts, np.asarray(logits)[:n].argmax(-1))]
    # Tables are allocated up front for the whole generation, so every decode step has one shape.
    for _ in range(max_new_tokens - 1):
        plan = plan_from_contexts(contexts, [1] * n, tables, bs)
        if decode_tables is not None:
            read = plan_from_contexts(contexts, [1] * n, decode_tables, bs)
            plan = dataclasses.replace(plan, block_tables=read.block_tables)
        logits, kv_pool = runner.step(kv_pool, plan)
        for ctx, t in zip(contexts, np.asarray(logits)[:n].argmax(-1)):
            ctx.append(int(t))
    return [ctx[len(p):] for ctx, p in zip(contexts, prompts)], kv_pool
