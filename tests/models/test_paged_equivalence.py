"""The paged step (prefill, step-by-step decode, prefix-cached prefill) equals the dense forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.paged_batch import plan_from_contexts, scattered_tables
from jpaged.config.presets import get_preset
from jpaged.models import decoder
from jpaged.models.kv_pool import init_kv_pool
from jpaged.models.runner import ModelRunner
from pallas_kernels import native_cpu

NUM_BLOCKS = 48
# The CPU attention backends: the XLA paths, and the native decode kernel where it builds.
CPU_BACKENDS = ["xla", pytest.param("cpu_native", marks=pytest.mark.skipif(
    not native_cpu.available(), reason=f"native CPU kernel: {native_cpu.unavailable_reason()}"))]


def sharp_params(spec, seed=0):
    """Dummy weights scaled up so attention is far from uniform (masking bugs cannot hide)."""
    params = decoder.init_params(spec, seed)
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x * 6 if path[-1].key in ("kernel", "embedding") else x, params)


def nan_pool(spec, block_size):
    """A pool whose every unused slot holds NaN: stale data must never reach an output."""
    k, v = init_kv_pool(spec, NUM_BLOCKS, block_size)
    return jnp.full_like(k, jnp.nan), jnp.full_like(v, jnp.nan)


def rel_err(got, want):
    return float(np.max(np.abs(np.asarray(got) - np.asarray(want))) / np.max(np.abs(np.asarray(want))))


# Both block sizes on CPU's default backend, both models; the XLA fallback at one block size (xla
# at block 8 is left out: its paging is block-size generic), tiny-llama in the default suite and
# tiny-opt in the slow tier (the models' own layers are the default backend's cases too).
DECODE_CASES = [pytest.param(16, "xla", id="xla-16"),
                *[pytest.param(bs, *case.values, marks=case.marks, id=f"cpu_native-{bs}") for bs in (8, 16)
                  for case in CPU_BACKENDS[1:]]]
MODEL_CASES = [pytest.param(name, *case.values, id=f"{case.id}-{name}",
                            marks=[*case.marks, *([pytest.mark.slow] if (case.id, name) == ("xla-16", "tiny-opt") else [])])
               for case in DECODE_CASES for name in ("tiny-opt", "tiny-llama")]


@pytest.mark.parametrize("name, block_size, backend", MODEL_CASES)
def test_decode_step_by_step_matches_dense(name, block_size, backend):
    spec = get_preset(name)
    params = sharp_params(spec)
    rng = np.random.default_rng(block_size)
    prompt_lens, new_tokens = [5, 19, 33], 9
    seqs = [list(rng.integers(1, spec.vocab_size, n + new_tokens)) for n in prompt_lens]
    max_blocks = -(-(max(prompt_lens) + new_tokens) // block_size)
    tables = scattered_tables(rng, [max_blocks] * len(seqs), NUM_BLOCKS)
    dense = [decoder.dense_forward(spec, params, jnp.asarray([s], jnp.int32))[0] for s in seqs]  # [L, V] each

    runner = ModelRunner(spec, params, block_size=block_size, attention_backend=backend)
    pool = nan_pool(spec, block_size)
    contexts = [s[:n] for s, n in zip(seqs, prompt_lens)]
    # Padded by odd amounts in every dimension: 7 tokens, a sequence and a block-table column.
    plan = plan_from_contexts(contexts, prompt_lens, tables, block_size,
                              shape=(sum(prompt_lens) + 7, 4, max_blocks + 1))
    logits, pool = runner.step(pool, plan)
    for s, n in enumerate(prompt_lens):
        assert rel_err(logits[s], dense[s][n - 1]) < 1e-4
    for step in range(1, new_tokens):
        contexts = [s[:n + step] for s, n in zip(seqs, prompt_lens)]
        plan = plan_from_contexts(contexts, [1] * 3, tables, block_size, shape=(4, 4, max_blocks + 1))
        logits, pool = runner.step(pool, plan)
        assert np.isfinite(np.asarray(logits[:3])).all()
        for s, n in enumerate(prompt_lens):
            assert rel_err(logits[s], dense[s][n + step - 1]) < 1e-4, (s, step)
    # One trace for the prefill shape, one for the decode shape: steady-state decode never recompiles.
    assert runner.num_compilations == 2


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
def test_prefix_cached_prefill_matches_full_prefill(name):
    spec, block_size = get_preset(name), 8
    params = sharp_params(spec, seed=1)
    rng = np.random.default_rng(0)
    prompt = list(rng.integers(1, spec.vocab_size, 29))
    other = list(rng.integers(1, spec.vocab_size, 11))
    table_a, table_b, table_o = scattered_tables(rng, [4, 4, 2], NUM_BLOCKS)
    runner = ModelRunner(spec, params, block_size=block_size, attention_backend="xla")
    pool = nan_pool(spec, block_size)

    full, pool = runner.step(pool, plan_from_contexts([prompt], [29], [table_a], block_size))
    # A second request with the same prompt shares the first 3 full blocks and prefills only its tail,
    # batched with an unrelated prompt.
    shared = table_a[:3] + table_b[3:]
    plan = plan_from_contexts([prompt, other], [29 - 24, 11], [shared, table_o], block_size, shape=(19, 3, 4))
    tail, pool = runner.step(pool, plan)
    dense_other = decoder.dense_forward(spec, params, jnp.asarray([other], jnp.int32))[0, -1]
    assert rel_err(tail[0], full[0]) < 1e-4
    assert rel_err(tail[1], dense_other) < 1e-4
