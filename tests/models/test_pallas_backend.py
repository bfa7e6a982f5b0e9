"""The runner on the Pallas kernels (interpret mode on CPU) gives the XLA path's logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from experiments.paged_batch import plan_from_contexts, scattered_tables
from jpaged.config.presets import get_preset
from jpaged.models import decoder
from jpaged.models.kv_pool import init_kv_pool
from jpaged.models.runner import ModelRunner


def test_pallas_backend_matches_xla():
    spec, block_size = get_preset("tiny-llama"), 16
    params = decoder.init_params(spec, seed=2)
    rng = np.random.default_rng(0)
    seqs = [list(rng.integers(1, spec.vocab_size, n)) for n in (21, 40)]
    tables = scattered_tables(rng, [3, 3], 12)
    runners = [ModelRunner(spec, params, block_size=block_size, attention_backend=b, interpret=True)
               for b in ("xla", "pallas")]
    results = []
    for runner in runners:
        k, v = init_kv_pool(spec, 12, block_size)
        pool = (jnp.full_like(k, jnp.nan), jnp.full_like(v, jnp.nan))
        prompts = [s[:-2] for s in seqs]
        prefill, pool = runner.step(pool, plan_from_contexts(
            prompts, [len(p) for p in prompts], tables, block_size, shape=(sum(map(len, prompts)) + 5, 3, 3)))
        decode, pool = runner.step(pool, plan_from_contexts([s[:-1] for s in seqs], [1, 1], tables, block_size,
                                                              shape=(4, 4, 3)))
        results.append((np.asarray(prefill[:2]), np.asarray(decode[:2])))
    for xla, pallas in zip(*results):
        np.testing.assert_allclose(pallas, xla, rtol=1e-4, atol=1e-4 * np.abs(xla).max())
