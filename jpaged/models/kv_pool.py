"""The paged KV pool: allocation, its bytes, and how many blocks a memory budget holds.

Layout: a tuple `(k_pool, v_pool)`, each `[num_layers, num_kv_heads, num_blocks, block_size,
head_dim]`, so one KV head's block is contiguous (what the kernels read). The model step never
slices `pool[layer]` out (a copy); the kernels take the stack and a layer index. Block 0 is
reserved as the padding target and never holds a live token. On CPU's XLA path a bfloat16 pool is
stored as its uint16 bits (`storage_dtype`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jpaged.config import INT32_LIMIT, MAX_BLOCKS
from jpaged.config.presets import ModelSpec

KVPool = tuple[jax.Array, jax.Array]


def storage_dtype(dtype: Any, backend: str | None = None, attention_backend: str = "xla") -> jnp.dtype:
    """The dtype a KV pool of `dtype` values is stored in: bfloat16 as uint16 bits on CPU's XLA and
    cpu_native paths (`attention_backend` resolved, `pallas_kernels.backends.resolve_backend`).

    XLA:CPU gathers and scatters no bfloat16 array: a bf16 pool would be converted whole to
    float32 (or, bitcast inside the step, copied whole) in every step. Stored as its bits, the
    step's gathers and scatters move integers and the pages are bitcast back to bfloat16 once
    read (`pallas_kernels.common.kv_dtype` / `gather_pages`); the values are the same bits.
    Elsewhere (GPU, the Pallas kernels) the pool keeps its dtype.
    """
    dtype = jnp.dtype(dtype)
    backend = backend or jax.default_backend()
    if dtype == jnp.bfloat16 and backend == "cpu" and attention_backend in ("xla", "cpu_native"):
        return jnp.dtype(jnp.uint16)
    return dtype


def init_kv_pool(spec: ModelSpec, num_blocks: int, block_size: int, dtype: Any = jnp.float32) -> KVPool:
    """A zeroed `(k_pool, v_pool)`, each [num_layers, num_kv_heads, num_blocks, block_size, head_dim]."""
    if num_blocks < 2:
        raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    shape = (spec.num_layers, spec.num_kv_heads, num_blocks, block_size, spec.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def num_blocks_for_budget(budget_bytes: int, block_bytes: int, block_size: int) -> int:
    """Blocks of `block_bytes` that fit in `budget_bytes` (0 for a budget below one block), at most
    MAX_BLOCKS and fewer than 2**31 slots (slot ids are int32). The count includes block 0."""
    return max(0, min(budget_bytes // block_bytes, MAX_BLOCKS, (INT32_LIMIT - 1) // block_size))


@dataclasses.dataclass(frozen=True)
class KVCacheSize:
    """A device pool's size as the start-up log and `LLMEngine.kv_stats()` report it."""

    num_blocks: int  # blocks, the reserved block 0 included
    block_size: int  # tokens per block
    block_bytes: int  # one block's K and V, every layer, on one device
    max_model_len: int  # tokens of the longest request

    @property
    def bytes(self) -> int:
        """Bytes of the pool on one device."""
        return self.num_blocks * self.block_bytes

    @property
    def blocks_per_request(self) -> int:
        """Blocks one request of max_model_len tokens holds."""
        return -(-self.max_model_len // self.block_size)

    @property
    def max_concurrency(self) -> float:
        """Requests of max_model_len tokens the pool holds at once (block 0 holds none)."""
        return (self.num_blocks - 1) / self.blocks_per_request

    def describe(self) -> str:
        """The start-up log line (vLLM's wording)."""
        return (f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens ({self.bytes / 2**30:.2f} GiB), "
                f"maximum concurrency for {self.max_model_len} tokens per request: {self.max_concurrency:.2f}x")
