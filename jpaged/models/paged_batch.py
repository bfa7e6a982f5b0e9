"""Paged batches without the engine: scattered block tables, and greedy generation over them.

A minimal stand-in for the block manager and scheduler, small enough to trust, used by model tests,
the tiny-model training script and demos. Its steps are `StepPlan.from_contexts` plans, padded as
the scheduler pads.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from jpaged.core.step_plan import StepPlan

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


def greedy_generate(runner: ModelRunner, kv_pool: KVPool, prompts: list[list[int]], max_new_tokens: int,
                    tables: list[list[int]], *, decode_tables: list[list[int]] | None = None,
                    ) -> tuple[list[list[int]], KVPool]:
    """Greedy decoding of a batch: one prefill of all prompts, then `max_new_tokens - 1` decode steps.

    `tables[s]` must hold len(prompts[s]) + max_new_tokens - 1 tokens. `decode_tables` (default
    `tables`) lets a test read a deliberately corrupted cache during decode (writes still go through
    `tables`). Returns the generated tokens and the updated (donated-through) pool.
    """
    bs, n = runner.block_size, len(prompts)
    logits, kv_pool = runner.prefill(kv_pool, StepPlan.from_contexts(prompts, [len(p) for p in prompts], tables, bs))
    contexts = [list(p) + [int(t)] for p, t in zip(prompts, np.asarray(logits)[:n].argmax(-1))]
    # Tables are allocated up front for the whole generation, so every decode step has one shape.
    for _ in range(max_new_tokens - 1):
        plan = StepPlan.from_contexts(contexts, [1] * n, tables, bs)
        if decode_tables is not None:
            read = StepPlan.from_contexts(contexts, [1] * n, decode_tables, bs)
            plan = dataclasses.replace(plan, block_tables=read.block_tables)
        logits, kv_pool = runner.decode(kv_pool, plan)
        for ctx, t in zip(contexts, np.asarray(logits)[:n].argmax(-1)):
            ctx.append(int(t))
    return [ctx[len(p):] for ctx, p in zip(contexts, prompts)], kv_pool
