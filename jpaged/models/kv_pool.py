"""The paged KV pool: allocation and sizing from a memory budget.

Layout: a tuple `(k_pool, v_pool)`, each `[num_layers, num_kv_heads, num_blocks, block_size,
head_dim]`, so one KV head's block is contiguous (what the kernels read). The model step never
slices `pool[layer]` out (a copy); the kernels take the stack and a layer index. Block 0 is
reserved as the padding target and never holds a live token. On CPU's XLA path a bfloat16 pool is
stored as its uint16 bits (`storage_dtype`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

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


def device_memory_bytes(device: jax.Device | None = None) -> int:
    """Memory the allocator may use on `device` (default: this process's first device), from its memory
    stats (a multi-host run's `jax.devices()[0]` may belong to another process, whose stats raise)."""
    device = device or jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ValueError(f"budget: a fraction of device memory needs memory stats, which {device.platform} "
                         "does not report; pass the budget in bytes instead")
    return int(stats["bytes_limit"])


def num_blocks_for_budget(spec: ModelSpec, block_size: int, budget: int | float, dtype: Any = jnp.float32,
                          *, reserved_bytes: int = 0, device: jax.Device | None = None) -> int:
    """How many KV blocks fit in `budget` after the parameters (and `reserved_bytes` of activations).

    `budget` is bytes (an int) or a fraction of device memory (a float in (0, 1]), as vLLM's
    gpu_memory_utilization. The count includes the reserved block 0; ValueError when not even two
    blocks fit, naming the bytes that are missing.
    """
    if isinstance(budget, float):
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"budget: a fraction must be in (0, 1], got {budget}")
        budget_bytes = int(budget * device_memory_bytes(device))
    elif isinstance(budget, int) and budget > 0:
        budget_bytes = budget
    else:
        raise ValueError(f"budget must be positive bytes (int) or a fraction in (0, 1] (float), got {budget!r}")
    block_bytes = block_size * spec.kv_bytes_per_token(dtype)
    free = budget_bytes - spec.param_bytes(dtype) - reserved_bytes
    num_blocks = free // block_bytes
    if num_blocks < 2:
        raise ValueError(f"budget: {budget_bytes} bytes leave {max(free, 0)} for the KV pool after "
                         f"{spec.param_bytes(dtype)} bytes of {spec.name} parameters; two blocks need "
                         f"{2 * block_bytes}")
    return int(num_blocks)
