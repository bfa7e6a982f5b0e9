"""The device KV pool sized from memory (jpaged.executors.kv_sizing): the formula against the bytes of
the pool the executor really builds, on a fake device memory size; kv_cache_memory_bytes; num_blocks
winning over both; the error when one max-length request cannot fit; the start-up log line and
kv_stats(); the simulator's unchanged default."""

import logging
import re

import jax
import pytest

from jpaged.config import SIM_NUM_BLOCKS, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, config_from_dict
from jpaged.core.sched.scheduler import Scheduler
from jpaged.engine import LLMEngine
from jpaged.entrypoints.engine_args import engine_config
from jpaged.executors import kv_sizing
from jpaged.executors.jax import JaxExecutor
from jpaged.executors.kv_sizing import DeviceMemory, kv_cache_size
from jpaged.models.kv_pool import init_kv_pool

MIB = 2**20
# tiny-llama: 2 layers x 2 KV heads x 16 dims, float32 on CPU: one 8-token block is 4 KiB (K and V)
SCHED = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)


def _config(**cache) -> EngineConfig:
    return EngineConfig(model=ModelConfig(name="tiny-llama", attention_backend="xla"),
                        cache=CacheConfig(block_size=8, num_host_blocks=0, **cache), scheduler=SCHED)


def _never() -> DeviceMemory:
    raise AssertionError("memory was read although the pool's size was given")


def _pool_bytes(executor: JaxExecutor) -> int:
    k, v = executor.kv_pool
    return k.nbytes + v.nbytes


@pytest.fixture(scope="module")
def sized():
    """An executor whose pool is half of a fake 8 MiB device with 1 MiB in use, and that fake memory."""
    memory = DeviceMemory(total_bytes=8 * MIB, in_use_bytes=1 * MIB, where="fake memory")
    config = _config(gpu_memory_utilization=0.5)
    return config, JaxExecutor(config, memory=lambda: memory), memory


def test_formula_matches_the_pool_built(sized):
    config, executor, memory = sized
    block_bytes = 8 * executor.spec.kv_bytes_per_token(executor.dtype)
    # The activation peak of the largest step, measured again on a fresh 2-block pool: the step's
    # temporaries do not depend on the pool's size.
    peak = kv_sizing.activation_bytes(executor.runner, config, init_kv_pool(executor.spec, 2, 8, executor.kv_dtype))
    assert 0 < peak < 4 * MIB
    assert kv_sizing.largest_step(config).num_tokens == SCHED.max_num_batched_tokens
    expected = (int(0.5 * memory.total_bytes) - memory.in_use_bytes - peak) // block_bytes
    size = executor.kv_cache
    assert size.num_blocks == expected == executor.kv_pool[0].shape[2]
    assert _pool_bytes(executor) == size.bytes == expected * block_bytes
    assert 0.5 * memory.total_bytes - memory.in_use_bytes - peak - block_bytes < size.bytes


def test_engine_takes_the_sized_count_and_reports_it(sized, caplog):
    config, executor, _ = sized
    engine = LLMEngine(config, executor=executor)
    size = executor.kv_cache
    assert engine.config.cache.num_blocks == size.num_blocks
    assert engine.scheduler.block_manager.num_usable_blocks == size.num_blocks - 1
    stats = engine.kv_stats()
    assert stats["num_blocks"] == size.num_blocks and stats["num_total_blocks"] == size.num_blocks - 1
    assert stats["block_size"] == 8
    assert stats["kv_cache_bytes"] == _pool_bytes(executor)
    assert stats["max_concurrency"] == pytest.approx((size.num_blocks - 1) / (64 // 8))
    assert size.describe() == (f"KV cache: {size.num_blocks} blocks of 8 tokens ({size.bytes / 2**30:.2f} GiB), "
                               f"maximum concurrency for 64 tokens per request: {stats['max_concurrency']:.2f}x")
    with caplog.at_level(logging.INFO, logger="jpaged.executors.jax"):
        JaxExecutor(_config(kv_cache_memory_bytes=20 * 4096), memory=_never)
    assert "KV cache: 20 blocks of 8 tokens (0.00 GiB), maximum concurrency for 64 tokens per request: 2.38x" \
        in caplog.text


def test_kv_cache_memory_bytes_and_num_blocks_need_no_profile():
    block_bytes = 4096
    executor = JaxExecutor(_config(kv_cache_memory_bytes=30 * block_bytes + 100), memory=_never)
    assert executor.kv_cache.num_blocks == 30 and _pool_bytes(executor) == 30 * block_bytes
    # num_blocks wins over both budgets (no memory read, no profile)
    executor = JaxExecutor(_config(num_blocks=12, kv_cache_memory_bytes=10**9, gpu_memory_utilization=0.01),
                           memory=_never)
    assert executor.kv_cache.num_blocks == 12 and _pool_bytes(executor) == 12 * block_bytes


def test_a_pool_without_room_for_one_request_is_refused_naming_the_fields():
    # 64 tokens in blocks of 8: one request needs 8 blocks + block 0
    with pytest.raises(ValueError, match=r"cache.kv_cache_memory_bytes=32768 .*8 KV blocks.* the 9 one request of "
                                         r"scheduler.max_model_len=64 tokens needs"):
        JaxExecutor(_config(kv_cache_memory_bytes=8 * 4096), memory=_never)
    config = _config(gpu_memory_utilization=0.5)
    memory = DeviceMemory(total_bytes=4 * MIB, in_use_bytes=2 * MIB - 10 * 4096, where="fake memory")
    with pytest.raises(ValueError) as error:
        kv_cache_size(config, 4096, lambda: memory, lambda: 3 * 4096)
    for name in ("cache.gpu_memory_utilization=0.5", "fake memory", "scheduler.max_num_batched_tokens=32",
                 "7 KV blocks", "scheduler.max_model_len=64", "cache.kv_cache_memory_bytes", "cache.num_blocks"):
        assert name in str(error.value)
    # two blocks more and it fits
    assert kv_cache_size(config, 4096, lambda: memory, lambda: 4096).num_blocks == 8 + 1
    with pytest.raises(ValueError, match="leaves 0.00 GiB: 0 KV blocks"):  # weights beyond the budget
        kv_cache_size(config, 4096, lambda: DeviceMemory(MIB, MIB, "fake memory"), lambda: 0)


def test_the_simulator_and_explicit_configs_keep_their_block_counts():
    assert CacheConfig().num_blocks is None
    assert EngineConfig(executor="sim").cache.num_blocks == SIM_NUM_BLOCKS == 984
    assert EngineConfig(executor="sim", cache=CacheConfig(num_blocks=40)).cache.num_blocks == 40
    assert EngineConfig().cache.num_blocks is None  # the real executor sizes it
    loaded = config_from_dict(EngineConfig, {"cache": {"num_blocks": None, "gpu_memory_utilization": 0.7}})
    assert (loaded.cache.num_blocks, loaded.cache.gpu_memory_utilization) == (None, 0.7)
    config = engine_config("tiny-llama", gpu_memory_utilization=0.6, kv_cache_memory_bytes=2**20)
    assert (config.cache.gpu_memory_utilization, config.cache.kv_cache_memory_bytes) == (0.6, 2**20)
    with pytest.raises(ValueError, match="cache.num_blocks: None"):
        Scheduler(SCHED, CacheConfig())


@pytest.mark.parametrize("field, value, error, text", [
    ("gpu_memory_utilization", 0.0, ValueError, "in (0, 1]"),
    ("gpu_memory_utilization", 1.5, ValueError, "in (0, 1]"),
    ("gpu_memory_utilization", "0.9", TypeError, "'0.9'"),
    ("kv_cache_memory_bytes", 0, ValueError, ">= 1"),
    ("kv_cache_memory_bytes", 1.0e9, TypeError, "float"),
])
def test_bad_budgets_name_the_field(field, value, error, text):
    with pytest.raises(error, match=rf"cache.{field}.*{re.escape(text)}"):
        CacheConfig(**{field: value})


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="a device with memory stats reports its own")
def test_cpu_memory_is_the_free_host_memory():
    memory = kv_sizing.device_memory()
    assert memory.where == "free host memory" and memory.in_use_bytes == 0
    assert abs(memory.total_bytes - kv_sizing.host_available_bytes()) < 2**30  # (other processes come and go)
    assert memory.cap_bytes == kv_sizing.cpu_kv_cache_cap()


def test_the_cpu_cap_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(kv_sizing.CPU_KV_CACHE_ENV, raising=False)
    assert kv_sizing.cpu_kv_cache_cap() == kv_sizing.CPU_KV_CACHE_BYTES == 4 * 2**30
    monkeypatch.setenv(kv_sizing.CPU_KV_CACHE_ENV, str(8 * MIB))
    assert kv_sizing.cpu_kv_cache_cap() == 8 * MIB
    monkeypatch.setenv(kv_sizing.CPU_KV_CACHE_ENV, "lots")
    with pytest.raises(ValueError, match="JPAGED_CPU_KV_CACHE_BYTES.*'lots'"):
        kv_sizing.cpu_kv_cache_cap()


def test_a_budget_from_free_host_memory_is_capped():
    config = EngineConfig(model=ModelConfig(name="tiny-llama"), cache=CacheConfig(block_size=16),
                          scheduler=SchedulerConfig(max_model_len=64, max_num_batched_tokens=64, max_num_seqs=4))
    huge = DeviceMemory(total_bytes=64 * 2**30, in_use_bytes=0, where="free host memory", cap_bytes=8 * MIB)
    pool = kv_cache_size(config, 4096, lambda: huge, lambda: 0)
    assert pool.num_blocks == 8 * MIB // 4096


def test_serve_flags_reach_the_cache_config():
    import argparse

    from jpaged.entrypoints import cli
    from jpaged.entrypoints.engine_flags import engine_args_from

    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--model", "tiny-llama", "--gpu-memory-utilization", "0.8",
                              "--kv-cache-memory-bytes", "1048576"])
    cache = engine_config("tiny-llama", **engine_args_from(args)).cache
    assert (cache.num_blocks, cache.gpu_memory_utilization, cache.kv_cache_memory_bytes) == (None, 0.8, 2**20)
