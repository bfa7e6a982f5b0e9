"""ContiguousBlockManager: Orca's reservation policies on hand-computed cases, slots and block
tables of contiguous regions, the usage breakdown, and serving through the engine."""

import numpy as np
import pytest

from jpaged.core.kv.kv_manager import usage
from jpaged.paper.baselines.contiguous import ContiguousBlockManager
from tests.helpers.kv import reserve

BS = 16


def manager(policy, num_units=64, max_model_len=256):
    return ContiguousBlockManager(num_units + 1, BS, max_model_len, policy, max_seqs=4)


@pytest.mark.parametrize("policy, prompt, final_len, blocks, region", [
    ("oracle", 20, 45, 3, 4),  # 45 tokens -> 3 blocks -> buddy 4
    ("oracle", 20, 64, 4, 4),  # exactly 4 blocks
    ("pow2", 20, 45, 4, 4),  # output 25 -> 32: 52 tokens -> 4 blocks
    ("pow2", 100, 133, 11, 16),  # output 33 -> 64: 164 tokens -> 11 blocks -> buddy 16
    ("max", 20, 45, 16, 16),  # 256 tokens whatever the request
])
def test_reservation_by_hand(policy, prompt, final_len, blocks, region):
    bm = manager(policy)
    assert bm.reserved_blocks(prompt, final_len) == blocks
    reserve(bm, 7, prompt, final_len)
    assert bm.region(7) == (1, region)  # lowest address first; unit 0 is block 1
    assert bm.num_free_blocks == 64 - region


def test_pow2_is_capped_at_max_model_len():
    bm = manager("pow2")
    # output 130 -> 256, capped: 100 + 256 > 256 -> 256 tokens = 16 blocks
    assert bm.reserved_blocks(100, 230) == 16


def test_block_table_slots_and_append():
    bm = manager("oracle")
    reserve(bm, 0, 8, 60)  # 60 tokens -> 4 blocks, region [1, 5)
    row = bm.admit(1, final_len=40, num_tokens=17)  # 40 tokens -> 3 blocks -> buddy 4: region [5, 9)
    assert bm.region(1) == (5, 4)
    slots, _ = bm.append_slots(np.array([row]), np.array([17]))  # a 17-token prompt chunk
    np.testing.assert_array_equal(bm.rows.table(1), [5, 6])
    np.testing.assert_array_equal(slots, np.arange(5 * BS, 5 * BS + 17))
    rows = np.array([bm.rows.row_of(0), row])
    slots, pairs = bm.append_slots(rows)
    assert pairs == [] and slots.tolist() == [1 * BS + 8, 5 * BS + 17]
    for _ in range(14):  # row 1 gets positions 18..31, the end of its second block
        slots, _ = bm.append_slots(rows[1:])
    assert slots.tolist() == [5 * BS + 31]
    np.testing.assert_array_equal(bm.rows.table(1), [5, 6])
    slots, _ = bm.append_slots(rows[1:])  # position 32 opens the third block
    assert slots.tolist() == [7 * BS]
    np.testing.assert_array_equal(bm.rows.table(1), [5, 6, 7])
    assert bm.rows.num_tokens[row] == 33


def test_outgrowing_the_region_is_a_bug():
    bm = manager("oracle")
    row = reserve(bm, 0, 15, 16)  # 1 block
    bm.append_slots(np.array([row]))
    with pytest.raises(RuntimeError, match="outgrew"):
        bm.append_slots(np.array([row]))


def test_can_admit_later_the_fit_rule_and_free_coalesces():
    bm = manager("max", num_units=40)  # top blocks 32 + 8; max = 16 blocks
    assert bm.fits(10, final_len=20) and bm.can_admit(10, 10, final_len=20)
    reserve(bm, 0, 10, 20)
    reserve(bm, 1, 10, 20)
    assert not bm.can_admit(10, 10, final_len=20)  # 8 blocks free, none of 16
    bm.free(0)
    assert bm.can_admit(10, 1, final_len=20)  # a chunk reserves the whole region too
    bm.free(1)
    assert bm.num_free_blocks == 40 and usage(bm) == 0.0
    big = manager("max", num_units=8)  # a 16-block reservation never fits in 8 blocks
    assert not big.fits(10, final_len=20) and not big.can_admit(10, 10, final_len=20)
    assert big.fits(10)  # without a final length (the door) only the tokens count
    with pytest.raises(KeyError, match="sequence 5"):
        bm.free(5)
    with pytest.raises(ValueError, match="width"):
        bm.can_admit(10, 10, width=0, final_len=20)


def test_group_reserves_regions_and_fork_copies_the_parent():
    bm = manager("oracle", num_units=16)
    assert bm.can_admit(20, 20, width=3, final_len=40)  # 3 blocks -> buddy 4; four fit in 16
    assert bm.fits(20, width=4, final_len=40) and not bm.fits(20, width=5, final_len=40)
    row = reserve(bm, 0, 20, 40, width=3)
    assert bm.num_free_blocks == 16 - 3 * 4
    assert not bm.can_admit(20, 20, width=2, final_len=40)
    assert bm.can_admit(20, 20, final_len=40)
    child = bm.fork(0, 1)
    assert bm.region(1) == (9, 4) and bm.rows.num_tokens[child] == 20  # the last spare region
    np.testing.assert_array_equal(bm.rows.table(1), [9, 10])
    slots, pairs = bm.append_slots(np.array([row, child]))
    assert pairs == [(1, 9), (2, 10)] and slots.tolist() == [1 * BS + 20, 9 * BS + 20]
    assert bm.append_slots(np.array([row]))[1] == []  # copies are issued once
    token, reserved, internal, _ = bm.usage_breakdown()
    assert token + reserved + internal == 12 * BS  # the spare region counts as reserved
    bm.free(1)  # back to the group's spares, not to the buddy
    assert bm.num_free_blocks == 4
    bm.free(0)
    assert bm.num_free_blocks == 16 and usage(bm) == 0.0


def test_beam_fork_without_spare_waits_for_a_dropped_sibling():
    bm = manager("oracle", num_units=16)
    reserve(bm, 0, 20, 40, width=2)
    bm.fork(0, 1)  # takes the spare
    child = bm.fork(0, 2)  # beam 0 had both kids; beam 1 is dropped after
    with pytest.raises(RuntimeError, match="no region"):
        bm.append_slots(np.array([child]))
    bm.free(1)
    assert bm.region(2) == (5, 4)
    _, pairs = bm.append_slots(np.array([bm.rows.row_of(0), child]))
    assert (1, 5) in pairs and (2, 6) in pairs
    bm.free(0)
    bm.free(2)
    assert bm.num_free_blocks == 16


def test_orca_serves_parallel_sampling_and_beam_search_in_the_simulator():
    from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from jpaged.core.sequence import SamplingParams
    from jpaged.paper.systems import build_engine

    config = EngineConfig(model=ModelConfig(name="opt-13b"), cache=CacheConfig(num_blocks=200, num_host_blocks=0),
                          scheduler=SchedulerConfig(max_model_len=2048), executor="sim")
    prompts = [list(range(4, 4 + n)) for n in (19, 40, 7, 33)]
    for params in (SamplingParams(n=4, temperature=1.0, max_tokens=30, ignore_eos=True),
                   SamplingParams(n=3, use_beam_search=True, max_tokens=25, ignore_eos=True)):
        engine = build_engine("orca_oracle", config)
        outputs = engine.generate(prompts, params, use_tqdm=False)
        assert all(len(o.output_token_ids) == params.n and o.error is None for o in outputs)
        assert engine.scheduler.block_manager.num_free_blocks == 199


def test_usage_breakdown_by_hand():
    bm = manager("pow2")
    reserve(bm, 0, 20, 45)  # region 4 blocks = 64 slots; writes 44 positions
    reserve(bm, 1, 100, 133)  # region 16 blocks = 256 slots; writes 132 positions
    token, reserved, internal, external = bm.usage_breakdown()
    assert token == 120 and reserved == (44 - 20) + (132 - 100)
    assert internal == (64 - 44) + (256 - 132) and external == 0
    assert token + reserved + internal == (bm.num_usable_blocks - bm.num_free_blocks) * BS == 20 * BS
    # Regions at [0,4) and [16,32) (the 4-block one split [0,16) into 4 + 4 + 8): free 4 + 8 + 32.
    # A next request needing 16 blocks can use only the 32-block top block.
    _, _, _, external = bm.usage_breakdown(next_request=(100, 200))
    assert external == (4 + 8) * BS


# ---------------------------------------------------------------------------------------------
# Through the engine


def test_real_model_tokens_match_vllm():
    """Contiguous regions are valid block tables: greedy tokens equal the paged engine's."""
    from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from jpaged.core.sequence import SamplingParams
    from jpaged.paper.systems import build_engine

    config = EngineConfig(model=ModelConfig(name="tiny-opt", attention_backend="xla"),
                          cache=CacheConfig(block_size=8, num_blocks=65, num_host_blocks=0, watermark=0.0),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=64),
                          executor="jax")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 256, n).tolist() for n in (5, 17, 9, 30)]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 6, 20, 9)]
    outputs = {system: [o.output_token_ids[0] for o in build_engine(system, config).generate(prompts, params,
                                                                                              use_tqdm=False)]
               for system in ("vllm", "orca_pow2")}
    assert [len(o) for o in outputs["vllm"]] == [12, 6, 20, 9]
    assert outputs["orca_pow2"] == outputs["vllm"]


@pytest.mark.parametrize("system", ["vllm", "orca_oracle", "orca_pow2", "orca_max", "fastertransformer"])
def test_breakdown_partitions_the_slot_space_at_every_step(system):
    """token + reserved + internal = allocated slots, external <= free slots, at every step."""
    from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from jpaged.paper.kv_usage import usage_breakdown
    from jpaged.paper.systems import build_engine
    from jpaged.paper.trace_runner import run_trace
    from jpaged.paper.workloads import WorkloadConfig, generate_trace

    config = EngineConfig(model=ModelConfig(name="opt-13b"),
                          cache=CacheConfig(block_size=16, num_blocks=301, num_host_blocks=0),
                          scheduler=SchedulerConfig(max_model_len=2048), executor="sim")
    engine = build_engine(system, config)
    bm = engine.scheduler.block_manager
    total = bm.num_usable_blocks * BS
    checked = []

    def check(start, plan):
        token, reserved, internal, external = usage_breakdown(engine.scheduler)
        allocated = (bm.num_usable_blocks - bm.num_free_blocks) * BS
        assert min(token, reserved, internal, external) >= 0
        assert token + reserved + internal == allocated
        assert external <= total - allocated
        checked.append(external)

    trace = generate_trace(WorkloadConfig(request_rate=4.0, duration_s=20, seed=1), vocab_size=50272)
    result = run_trace(engine, trace, observer=check, track_kv=True)
    assert len(result.records) == len(trace) and len(checked) == result.num_steps
    assert sum(result.kv_usage.values()) == pytest.approx(100.0)
    assert all(r.output_len == t.output_len for r, t in zip(sorted(result.records, key=lambda r: r.request_id), trace))
    if system != "vllm":
        assert result.num_preemptions == 0 and max(checked) > 0  # a loaded buddy pool fragments
