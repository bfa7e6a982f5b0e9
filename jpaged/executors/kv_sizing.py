"""How many blocks the real executor's device KV pool gets (vLLM's --gpu-memory-utilization and
--kv-cache-memory-bytes), decided once the weights are loaded.

    cache.num_blocks given:             that count (it wins over both budgets)
    cache.kv_cache_memory_bytes given:  kv_cache_memory_bytes // block_bytes
    otherwise:                          (gpu_memory_utilization x total - in_use - activations) // block_bytes

`block_bytes` is one block's K and V, every layer, on one device (its share of the KV heads), and
with a draft model (speculative.method draft_model) its block too: its pool has as many blocks.
`total` and `in_use` (`DeviceMemory`): on a device that reports memory stats (GPU), its
bytes_limit and bytes_in_use with the weights loaded; on CPU, which reports none, the host's
free memory (MemAvailable) at that moment and 0: the loaded weights are already out of it, so the
same fraction applies to what is left, at most CPU_KV_CACHE_BYTES or $JPAGED_CPU_KV_CACHE_BYTES
(vLLM's CPU backend default, VLLM_CPU_KVCACHE_SPACE = 4 GiB: a host shared with everything else is not a device the engine owns,
and a pool of millions of small blocks costs start-up time for nothing). `activations`: the temporary memory of the largest step
the config can run (max_num_batched_tokens tokens, the widest block table), from XLA's memory
analysis of that compiled step (`ModelRunner.memory_analysis`), on every platform: JAX cannot
reset a device's peak_bytes_in_use, which after loading counts the load's own transients. Counts
are capped at MAX_BLOCKS (`kv_pool.num_blocks_for_budget`). A budgeted pool that cannot hold one
request of max_model_len tokens is a ValueError naming the fields to change.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax

from jpaged.config import EngineConfig
from jpaged.executors import warmup
from jpaged.models.kv_pool import KVCacheSize, KVPool, num_blocks_for_budget
from jpaged.models.runner import ModelRunner

GIB = 2**30
CPU_KV_CACHE_BYTES = 4 * GIB  # the most a pool sized from free host memory takes (default)
CPU_KV_CACHE_ENV = "JPAGED_CPU_KV_CACHE_BYTES"  # overrides it (vLLM: VLLM_CPU_KVCACHE_SPACE)


def cpu_kv_cache_cap() -> int:
    """The most bytes a pool sized from free host memory takes: $JPAGED_CPU_KV_CACHE_BYTES, else 4 GiB."""
    value = os.environ.get(CPU_KV_CACHE_ENV)
    if value is None:
        return CPU_KV_CACHE_BYTES
    try:
        cap = int(value)
    except ValueError:
        cap = 0
    if cap < 1:
        raise ValueError(f"${CPU_KV_CACHE_ENV} must be a whole number of bytes >= 1, got {value!r}")
    return cap


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """The memory a budget fraction is taken of."""

    total_bytes: int  # device: bytes_limit; CPU: free host memory (MemAvailable)
    in_use_bytes: int  # device: bytes_in_use (the loaded weights); CPU: 0 (already out of total)
    where: str  # what total is, for messages: "gpu memory", "free host memory"
    cap_bytes: int | None = None  # the most the budget may be (CPU: CPU_KV_CACHE_BYTES)


def host_available_bytes() -> int:
    """Free host memory: /proc/meminfo's MemAvailable (reclaimable caches included), else the
    free physical pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file counts kB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def device_memory() -> DeviceMemory:
    """This process's first device's memory (a local device: another process's stats raise), or the
    host's free memory where the device reports none (CPU)."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return DeviceMemory(int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0)), f"{device.platform} memory")
    return DeviceMemory(host_available_bytes(), 0, "free host memory", cpu_kv_cache_cap())


def largest_step(config: EngineConfig) -> warmup.ModelStep:
    """The model-step shape of `config` with the most tokens (then sequences, then table width)."""
    return max(warmup.model_steps(config), key=lambda s: (s.num_tokens, s.num_seqs, s.table_width))


def activation_bytes(runner: ModelRunner, config: EngineConfig, pool: KVPool) -> int:
    """Bytes the largest step of `config` needs beyond its inputs: XLA's temporaries plus the outputs
    that do not reuse a donated input (the logits), from the compiled program's memory analysis.
    `pool`: a small pool of the real one's dtype and sharding (the step's temporaries do not grow
    with the block count)."""
    analysis = runner.memory_analysis(pool, warmup.padding_plan(largest_step(config)))
    if analysis is None:  # a backend without memory analysis
        return 0
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)


def kv_cache_size(config: EngineConfig, block_bytes: int, memory: Callable[[], DeviceMemory],
                  activations: Callable[[], int]) -> KVCacheSize:
    """The device pool of `config` (see the module docstring). `memory` and `activations` are called
    only when the pool is sized from gpu_memory_utilization."""
    cache, sched = config.cache, config.scheduler

    def size(num_blocks: int) -> KVCacheSize:
        return KVCacheSize(num_blocks, cache.block_size, block_bytes, sched.max_model_len)

    if cache.num_blocks is not None:
        return size(cache.num_blocks)
    if cache.kv_cache_memory_bytes is not None:
        budget = cache.kv_cache_memory_bytes
        source = f"cache.kv_cache_memory_bytes={budget} ({budget / GIB:.2f} GiB)"
    else:
        mem, peak = memory(), activations()
        budget = int(cache.gpu_memory_utilization * mem.total_bytes) - mem.in_use_bytes - peak
        if mem.cap_bytes is not None:
            budget = min(budget, mem.cap_bytes)
        source = (f"cache.gpu_memory_utilization={cache.gpu_memory_utilization} of {mem.total_bytes / GIB:.2f} GiB "
                  f"of {mem.where}, less {mem.in_use_bytes / GIB:.2f} GiB in use (the weights) and "
                  f"{peak / GIB:.2f} GiB of activations of the largest step (scheduler.max_num_batched_tokens="
                  f"{sched.max_num_batched_tokens}), leaves {max(budget, 0) / GIB:.2f} GiB"
                  + (f" (at most {mem.cap_bytes / GIB:.0f} GiB)" if mem.cap_bytes is not None else ""))
    pool = size(num_blocks_for_budget(budget, block_bytes, cache.block_size))
    if pool.num_blocks - 1 < pool.blocks_per_request:
        raise ValueError(
            f"{source}: {pool.num_blocks} KV blocks of {cache.block_size} tokens ({block_bytes} bytes each), "
            f"fewer than the {pool.blocks_per_request + 1} one request of scheduler.max_model_len="
            f"{sched.max_model_len} tokens needs (block 0 is reserved); raise cache.gpu_memory_utilization or "
            f"cache.kv_cache_memory_bytes, give cache.num_blocks, or lower scheduler.max_model_len")
    return pool
