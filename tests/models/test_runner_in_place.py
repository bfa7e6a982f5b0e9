"""The model step updates the donated KV pool in place: no copy of the pool (or of a layer of it)
per step, only the written slots move. Checked on the compiled CPU step (scratch and aliased
bytes, buffer pointers) and on the Pallas step lowered for CUDA (no layer slice in the program)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.paged_batch import plan_from_contexts
from jpaged.config.presets import get_preset
from jpaged.models import decoder
from jpaged.models.kv_pool import init_kv_pool
from jpaged.models.runner import ModelRunner
from pallas_kernels.targets import A100, abstract_gpu
from tests.models.test_paged_equivalence import CPU_BACKENDS

BLOCK_SIZE, NUM_BLOCKS = 16, 1024  # a pool much larger than the activations: a copy would stand out


def _setup(backend="xla", interpret=True):
    spec = get_preset("tiny-llama")
    runner = ModelRunner(spec, decoder.init_params(spec), block_size=BLOCK_SIZE, attention_backend=backend,
                         interpret=interpret)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3]]
    decode = plan_from_contexts(prompts, [1, 1], [[7], [9]], BLOCK_SIZE, shape=(4, 4, 1))
    prefill = plan_from_contexts(prompts, [7, 3], [[7], [9]], BLOCK_SIZE, shape=(16, 2, 1))
    return spec, runner, {"decode": decode, "prefill": prefill}


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_compiled_step_aliases_the_pool_and_needs_no_layer_of_scratch(kind, backend):
    spec, runner, plans = _setup(backend)
    pool = init_kv_pool(spec, NUM_BLOCKS, BLOCK_SIZE)
    mem = runner.lower(pool, plans[kind]).compile().memory_analysis()
    pool_bytes = pool[0].nbytes + pool[1].nbytes  # 8 MiB
    layer_bytes = pool_bytes // spec.num_layers  # K + V of one layer: 4 MiB
    # The whole pool is an output aliased to its donated input buffer.
    assert mem.alias_size_in_bytes == pool_bytes
    # Slicing a layer out for per-layer kernels needed a layer of scratch (4.3 MB measured); reading
    # and writing through the layer index needs only activations and gathered chunks (~0.15 MB).
    assert mem.temp_size_in_bytes < layer_bytes // 8


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_step_keeps_the_pool_buffers(backend):
    spec, runner, plans = _setup(backend)
    pool = init_kv_pool(spec, NUM_BLOCKS, BLOCK_SIZE)
    pointers = [p.unsafe_buffer_pointer() for p in pool]
    _, pool = runner.step(pool, plans["prefill"])
    assert [p.unsafe_buffer_pointer() for p in pool] == pointers
    _, pool = runner.step(pool, plans["decode"])
    assert [p.unsafe_buffer_pointer() for p in pool] == pointers
    # The prompts' K/V landed in blocks 7 and 9 of every layer; block 8 (never written) is still zero.
    k = np.asarray(pool[0])
    assert np.abs(k[:, :, 7, :7]).min() > 0 and np.abs(k[:, :, 9, :3]).min() > 0
    assert not k[:, :, 8].any()


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_pallas_step_for_cuda_never_slices_a_layer(kind):
    """The GPU program hands the whole stacked pool to the Triton kernels (compiled here for CUDA
    without a GPU): no value of one layer's shape exists anywhere in the step."""
    spec, runner, plans = _setup(backend="pallas", interpret=False)
    shape = (spec.num_layers, spec.num_kv_heads, 64, BLOCK_SIZE, spec.head_dim)
    pool = (jax.ShapeDtypeStruct(shape, jnp.float32),) * 2
    plan = plans[kind]
    no_scores = (np.zeros(len(plan.token_ids), np.int32), np.bool_(False), np.bool_(False))  # prompt scores off
    with abstract_gpu(A100):  # newer jax lowers Triton kernels only for a named (abstract) GPU
        traced = runner._step_fn.jitted.trace(runner.params, pool, *no_scores, **plan.device_arrays())
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
    layer = "tensor<{}xf32>".format("x".join(map(str, shape[1:])))
    assert layer not in text
