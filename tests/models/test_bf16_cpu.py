"""bfloat16 on CPU: the pool stored as uint16 bits computes exactly what a bfloat16 pool does, and the
bf16 paged step stays close to the float32 model it was rounded from."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.paged_batch import greedy_generate, plan_from_contexts, scattered_tables
from jpaged.config.presets import get_preset
from jpaged.models import decoder
from jpaged.models.kv_pool import init_kv_pool, storage_dtype
from jpaged.models.runner import ModelRunner
from pallas_kernels import cache_ops, native_cpu

BLOCK_SIZE = 8


def test_storage_dtype_is_bits_only_for_bf16_on_the_cpu_xla_path():
    assert storage_dtype(jnp.bfloat16, "cpu") == jnp.uint16
    assert storage_dtype(jnp.float32, "cpu") == jnp.float32
    assert storage_dtype(jnp.bfloat16, "gpu") == jnp.bfloat16
    assert storage_dtype(jnp.bfloat16, "cpu", attention_backend="pallas_triton") == jnp.bfloat16


# The pool's storage does not depend on the model: one model per test in the default suite, the
# other in the slow tier.
@pytest.mark.parametrize("name", [pytest.param("tiny-opt", marks=pytest.mark.slow), "tiny-llama"])
def test_bits_pool_matches_bf16_pool_exactly(name):
    spec = get_preset(name)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), decoder.init_params(spec))
    runner = ModelRunner(spec, params, block_size=BLOCK_SIZE, attention_backend="xla")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, spec.vocab_size, n).tolist() for n in (13, 5, 21)]
    need = [-(-(len(p) + 6) // BLOCK_SIZE) for p in prompts]
    tables = scattered_tables(rng, need, sum(need) + 3)
    results = []
    for dtype in (jnp.bfloat16, jnp.uint16):
        pool = init_kv_pool(spec, sum(need) + 3, BLOCK_SIZE, dtype)
        tokens, pool = greedy_generate(runner, pool, prompts, 6, tables)
        results.append((tokens, [np.asarray(p).view(np.uint16) for p in pool]))
    (tokens_bf16, pool_bf16), (tokens_bits, pool_bits) = results
    assert tokens_bf16 == tokens_bits
    for a, b in zip(pool_bf16, pool_bits):
        np.testing.assert_array_equal(a, b)


def test_bf16_step_logits_close_to_float32():
    """bf16 weights and KV with float32 accumulation: logits within bf16 rounding of float32's."""
    spec = get_preset("tiny-opt")
    params = decoder.init_params(spec)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, spec.vocab_size, n).tolist() for n in (9, 17)]
    need = [-(-len(p) // BLOCK_SIZE) for p in prompts]
    tables = scattered_tables(rng, need, sum(need) + 1)
    plan = plan_from_contexts(prompts, [len(p) for p in prompts], tables, BLOCK_SIZE)
    logits = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        runner = ModelRunner(spec, jax.tree.map(lambda x: x.astype(dtype), params), block_size=BLOCK_SIZE,
                             attention_backend="xla")
        pool = init_kv_pool(spec, sum(need) + 1, BLOCK_SIZE, storage_dtype(dtype, "cpu"))
        out, _ = runner.step(pool, plan)
        assert out.dtype == jnp.float32
        logits[dtype] = np.asarray(out)
    scale = np.abs(logits[jnp.float32]).max()
    assert np.abs(logits[jnp.bfloat16] - logits[jnp.float32]).max() < 0.05 * scale


def test_block_ops_move_bits_pools_exactly():
    rng = np.random.default_rng(2)
    values = np.asarray(rng.standard_normal((2, 3, 6, 4, 8)), jnp.bfloat16)  # [L, Hkv, N, Bs, D]

    def pools(bits: bool):  # fresh arrays each call: the block ops donate their pools
        pool = jnp.asarray(values.view(np.uint16) if bits else values)
        return pool, pool + 0

    pairs = jnp.asarray([[1, 4], [2, 5]], jnp.int32)
    k_bits, _ = cache_ops.copy_blocks(*pools(True), pairs)
    k_ref, _ = cache_ops.copy_blocks(*pools(False), pairs)
    np.testing.assert_array_equal(np.asarray(k_bits), np.asarray(k_ref).view(np.uint16))
    new = jnp.asarray(rng.standard_normal((3, 3, 8)), jnp.float32)  # [T, Hkv, D]
    slots = jnp.asarray([5, 9, 22], jnp.int32)
    written, _ = cache_ops.write_kv(*pools(True), new, new, slots, 1)
    expected, _ = cache_ops.write_kv(*pools(False), new, new, slots, 1)
    np.testing.assert_array_equal(np.asarray(written), np.asarray(expected).view(np.uint16))


@pytest.mark.skipif(not native_cpu.available(), reason=f"native CPU kernel: {native_cpu.unavailable_reason()}")
@pytest.mark.parametrize("name", ["tiny-opt", pytest.param("tiny-llama", marks=pytest.mark.slow)])
def test_native_decode_on_the_bits_pool_matches_the_xla_path(name):
    """The cpu_native backend reads the same uint16 pool: its decode logits equal the XLA path's
    up to float32 summation order (and the bf16 rounding of the attention output that follows)."""
    spec = get_preset(name)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), decoder.init_params(spec))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, spec.vocab_size, n).tolist() for n in (13, 5, 21)]
    need = [-(-(len(p) + 1) // BLOCK_SIZE) for p in prompts]
    tables = scattered_tables(rng, need, sum(need) + 3)
    runners = {b: ModelRunner(spec, params, block_size=BLOCK_SIZE, attention_backend=b) for b in ("xla", "cpu_native")}
    pool = init_kv_pool(spec, sum(need) + 3, BLOCK_SIZE, storage_dtype(jnp.bfloat16, "cpu", "cpu_native"))
    logits, pool = runners["xla"].step(pool, plan_from_contexts(prompts, [len(p) for p in prompts], tables,
                                                                   BLOCK_SIZE))
    contexts = [p + [int(t)] for p, t in zip(prompts, np.asarray(logits).argmax(-1))]
    decode = plan_from_contexts(contexts, [1] * 3, tables, BLOCK_SIZE, shape=(4, 4, max(map(len, tables))))
    out = {}
    for backend, runner in runners.items():
        step_logits, pool = runner.step(pool, decode)  # both write the same K/V bits, then read them
        out[backend] = np.asarray(step_logits[:3])
    scale = np.abs(out["xla"]).max()
    assert np.abs(out["cpu_native"] - out["xla"]).max() < 0.02 * scale
