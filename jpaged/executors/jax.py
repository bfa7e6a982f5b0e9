"""The real executor: block operations on the KV pool, then the jitted model step, on CPU or GPU.

The device pool is a `(k_pool, v_pool)` pair `[L, Hkv, N, Bs, D]`; the host swap space has the same
layout in host (numpy) memory. Block operations run in the order the scheduler relies on:
swap out (frees device blocks), swap in (may reuse them), copy-on-write, then the model writes.
Pair arrays are padded to power-of-two buckets so block operations do not recompile either.
"""

from __future__ import annotations

import logging
import time

import jax.numpy as jnp
import numpy as np

from jpaged.config import EngineConfig
from jpaged.executors.base import StepResult
from jpaged.checkpoint import load_params
from jpaged.models import decoder
from jpaged.models.kv_pool import init_kv_pool
from jpaged.models.presets import get_preset
from jpaged.models.runner import ModelRunner
from jpaged.step_plan import StepPlan, bucket
from pallas_kernels import cache_ops

logger = logging.getLogger(__name__)


def _padded(ids: np.ndarray, size: int) -> np.ndarray:
    """i32[size]: `ids` then zeros (block 0, the reserved padding target)."""
    out = np.zeros(size, np.int32)
    out[: len(ids)] = ids
    return out


class JaxExecutor:
    """Runs StepPlans on the real model with a paged KV pool on the default JAX device."""

    has_model = True

    def __init__(self, config: EngineConfig, params: decoder.Params | None = None):
        """`params` overrides config.model (dummy seeded weights or a local checkpoint)."""
        model, cache = config.model, config.cache
        if params is None:
            self.spec, params = load_params(model)
        else:
            self.spec = get_preset(model.name)
        self.dtype = jnp.dtype(model.dtype)
        self.runner = ModelRunner(self.spec, params, block_size=cache.block_size,
                                  attention_backend=model.attention_backend)
        self.kv_pool = init_kv_pool(self.spec, cache.num_blocks, cache.block_size, self.dtype)
        shape = (self.spec.num_layers, self.spec.num_kv_heads, cache.num_host_blocks, cache.block_size,
                 self.spec.head_dim)
        self.host_k = np.zeros(shape, dtype=self.dtype)  # [L, Hkv, H, Bs, D] swap space in host memory
        self.host_v = np.zeros(shape, dtype=self.dtype)
        self.vocab_size = self.spec.vocab_size
        self._start = time.perf_counter()

    @property
    def num_compilations(self) -> int:
        """Model-step compilations so far (one per distinct padded shape)."""
        return self.runner.num_compilations

    def now(self) -> float:
        """Seconds since the executor was built."""
        return time.perf_counter() - self._start

    def execute(self, plan: StepPlan) -> StepResult:
        """Applies swap-out, swap-in and copy-on-write, then runs the step; logits stay on device."""
        start = time.perf_counter()
        k_pool, v_pool = self.kv_pool
        if len(plan.swap_out_pairs):
            self._swap_out(k_pool, v_pool, plan.swap_out_pairs)
        if len(plan.swap_in_pairs):
            k_pool, v_pool = self._swap_in(k_pool, v_pool, plan.swap_in_pairs)
        if len(plan.copy_pairs):
            pairs = np.zeros((bucket(len(plan.copy_pairs), minimum=4), 2), np.int32)
            pairs[: len(plan.copy_pairs)] = plan.copy_pairs
            k_pool, v_pool = cache_ops.copy_blocks(k_pool, v_pool, jnp.asarray(pairs))
        logits = None
        if plan.num_seqs:
            step = self.runner.prefill if plan.is_prefill else self.runner.decode
            logits, (k_pool, v_pool) = step((k_pool, v_pool), plan)
            logits.block_until_ready()
        self.kv_pool = (k_pool, v_pool)
        return StepResult(logits, time.perf_counter() - start)

    def _swap_out(self, k_pool, v_pool, pairs: np.ndarray) -> None:
        size = bucket(len(pairs), minimum=4)
        device_ids = jnp.asarray(_padded(pairs[:, 0], size))
        n = len(pairs)
        host_ids = pairs[:, 1]
        self.host_k[:, :, host_ids] = np.asarray(cache_ops.gather_blocks(k_pool, device_ids))[:, :, :n]
        self.host_v[:, :, host_ids] = np.asarray(cache_ops.gather_blocks(v_pool, device_ids))[:, :, :n]

    def _swap_in(self, k_pool, v_pool, pairs: np.ndarray):
        size = bucket(len(pairs), minimum=4)
        device_ids = jnp.asarray(_padded(pairs[:, 1], size))
        blocks_shape = self.host_k.shape[:2] + (size,) + self.host_k.shape[3:]
        k_blocks = np.zeros(blocks_shape, self.dtype)
        v_blocks = np.zeros(blocks_shape, self.dtype)
        k_blocks[:, :, : len(pairs)] = self.host_k[:, :, pairs[:, 0]]
        v_blocks[:, :, : len(pairs)] = self.host_v[:, :, pairs[:, 0]]
        k_pool = cache_ops.scatter_blocks(k_pool, device_ids, jnp.asarray(k_blocks))
        v_pool = cache_ops.scatter_blocks(v_pool, device_ids, jnp.asarray(v_blocks))
        return k_pool, v_pool
