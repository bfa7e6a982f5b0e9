"""The draft model's host arrays (jpaged.executors.drafting): a verify plan's draft loop, its drafts
filled in, the drafts each sample row checked; and its pool following the target's block
operations. (On the real model: tests/engine/test_engine_speculative.py.)"""

import dataclasses

import jax
import numpy as np

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from jpaged.config.presets import get_preset
from jpaged.core.kv.block_manager import BlockManager
from jpaged.core.sched.plan_builder import verify_plan
from jpaged.core.sched.speculation import PLACEHOLDER
from jpaged.core.sequence import SamplingParams, Sequence, SequenceGroup
from jpaged.core.step_plan import StepPlan
from jpaged.executors.drafting import checked_drafts, draft_inputs, with_drafts
from jpaged.executors.jax import JaxExecutor
from jpaged.models import decoder
from tests.helpers.hf_dirs import HF_CONFIGS, write_hf_dir
from tests.helpers.kv import allocate


def _verify(lengths: list[int], drafts: list[int]):
    """A verify plan of sequences of `lengths` tokens (their KV holding all but the last), with
    `drafts[i]` placeholders each (block size 4)."""
    bm = BlockManager(32, 4, 0, max_model_len=64, watermark=0.0, max_seqs=4)
    seqs, rows = [], []
    for i, length in enumerate(lengths):
        seq = Sequence(i, list(range(10 * i + 1, 10 * i + 1 + length)))
        SequenceGroup(f"r{i}", [seq], SamplingParams(max_tokens=20), 0.0, 0)
        seqs.append(seq)
        rows.append(allocate(bm, i, length - 1))
    rows = np.array(rows)
    appended = bm.append_slots(rows, np.array([1 + d for d in drafts]))
    return verify_plan(bm, seqs, rows, [[PLACEHOLDER] * d for d in drafts], *appended)


def test_the_draft_loop_computes_each_sequences_verify_positions_then_pads():
    plan = _verify([6, 3], [3, 1])  # rows 0-3: t5, d1..d3 of sequence 0; rows 4-5: t2, d1 of sequence 1
    inputs = draft_inputs(plan, 3, max_blocks_per_seq=16)
    assert inputs.num_steps == 4 and inputs.positions.shape == (4, 2)  # two sequences: S = 2
    assert inputs.first_tokens[:2].tolist() == [6, 13]
    assert inputs.positions[:, :2].tolist() == [[5, 2], [6, 3], [7, 0], [8, 0]]
    np.testing.assert_array_equal(inputs.slot_mapping[:, 0], plan.slot_mapping[:4])
    assert inputs.slot_mapping[:2, 1].tolist() == plan.slot_mapping[4:6].tolist()
    assert inputs.slot_mapping[2:, 1].tolist() == [0, 0]  # past its one draft: block 0
    assert inputs.context_lens[:, :2].tolist() == [[6, 3], [7, 4], [8, 1], [9, 1]]
    assert inputs.block_tables.shape == (2, 16)
    np.testing.assert_array_equal(inputs.block_tables[:2, : plan.block_tables.shape[1]], plan.block_tables[:2])
    # d_j of a sequence is step j - 1's argmax; step 3 of sequence 0 only writes d_3's K/V.
    picked = np.arange(100, 132, dtype=np.int32).reshape(4, 8)  # picked[j, s] = 100 + 8 j + s
    filled = with_drafts(plan, inputs, picked)
    assert filled.token_ids[:6].tolist() == [6, 100, 108, 116, 13, 101]
    assert plan.token_ids[1] == PLACEHOLDER  # the scheduler's plan is left as it was
    assert checked_drafts(filled.sampling, filled.token_ids).tolist() == [100, 108, 116, -1, 101, -1]


def test_the_draft_loop_pads_to_a_power_of_two():
    plan = _verify([6, 3, 4], [2, 1, 1])  # three sequences: S = 4, row 3 padding
    inputs = draft_inputs(plan, 2, max_blocks_per_seq=16)
    assert inputs.positions.shape == (3, 4) and inputs.block_tables.shape == (4, 16)
    # A padded row computes one token at slot 0 of reserved block 0, one token of context.
    assert (inputs.context_lens[:, 3] == 1).all() and (inputs.slot_mapping[:, 3] == 0).all()
    assert (inputs.positions[:, 3] == 0).all() and (inputs.block_tables[3] == 0).all()
    assert draft_inputs(_verify([5], [2]), 2, max_blocks_per_seq=16).positions.shape == (3, 1)  # batch 1: S = 1


def test_a_sequence_without_drafts_computes_its_token_alone():
    plan = _verify([5, 4], [0, 2])
    inputs = draft_inputs(plan, 2, max_blocks_per_seq=16)
    assert inputs.num_steps == 3
    assert inputs.positions[:, :2].tolist() == [[4, 3], [0, 4], [0, 5]]
    picked = np.full((3, 8), 7, np.int32)
    filled = with_drafts(plan, inputs, picked)
    assert filled.token_ids[:4].tolist() == [5, 14, 7, 7]
    assert checked_drafts(filled.sampling, filled.token_ids).tolist() == [-1, 7, 7, -1]


def test_the_drafts_pool_is_swapped_and_copied_with_the_targets(tmp_path):
    spec = get_preset("tiny-opt")
    write_hf_dir(tmp_path / "draft", spec, decoder.init_params(spec, seed=1), HF_CONFIGS["tiny-opt"])
    config = EngineConfig(model=ModelConfig(name="tiny-opt", attention_backend="xla"),
                          cache=CacheConfig(block_size=4, num_blocks=12, num_host_blocks=8),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32),
                          speculative=SpeculativeConfig(method="draft_model", model=str(tmp_path / "draft"),
                                                        num_speculative_tokens=2))
    executor = JaxExecutor(config)
    rng = np.random.default_rng(0)
    executor.draft_pool = tuple(jax.numpy.asarray(rng.standard_normal(pool.shape, np.float32))
                                for pool in executor.draft_pool)
    before = [np.asarray(p) for p in executor.draft_pool]
    # Block 3 out to host block 5, back in as block 7, copied (copy-on-write) to block 9.
    for plan in (StepPlan.block_ops_only(swap_out=[(3, 5)]), StepPlan.block_ops_only(swap_in=[(5, 7)]),
                 StepPlan.block_ops_only(copy=[(7, 9)])):
        executor.execute(plan)
    for old, new in zip(before, executor.draft_pool):
        new = np.asarray(new)  # [L, Hkv, N, Bs, D]
        np.testing.assert_array_equal(new[:, :, [7, 9]], old[:, :, [3, 3]])
        # (block 0, the padding pairs' target, excepted)
        np.testing.assert_array_equal(np.delete(new, [0, 7, 9], axis=2), np.delete(old, [0, 7, 9], axis=2))


def test_a_pool_sized_from_a_budget_pays_for_the_drafts_blocks_too(tmp_path):
    spec = get_preset("tiny-opt")
    write_hf_dir(tmp_path / "draft", spec, decoder.init_params(spec, seed=1), HF_CONFIGS["tiny-opt"])
    block_bytes = 2 * spec.num_layers * spec.num_kv_heads * 4 * spec.head_dim * 4  # float32, block_size 4
    budget = 40 * block_bytes
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=32)
    alone = EngineConfig(model=ModelConfig(name="tiny-opt", attention_backend="xla"),
                         cache=CacheConfig(block_size=4, kv_cache_memory_bytes=budget), scheduler=scheduler)
    drafted = dataclasses.replace(alone, speculative=SpeculativeConfig(
        method="draft_model", model=str(tmp_path / "draft"), num_speculative_tokens=2))
    # The draft here is the target's shape: a block costs twice as much, so half as many fit.
    assert JaxExecutor(alone).kv_cache.num_blocks == 40
    executor = JaxExecutor(drafted)
    assert executor.kv_cache.num_blocks == 20
    assert executor.draft_pool[0].shape[2] == 20  # [L, Hkv, N, Bs, D]
