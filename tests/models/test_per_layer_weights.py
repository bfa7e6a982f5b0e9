"""The per-layer weight layout (CPU default) computes what the stacked, scanned layout does: the
same tokens, the same logits and cache to the last bits."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from experiments.paged_batch import plan_from_contexts, scattered_tables
from jpaged.config.presets import get_preset
from jpaged.models import decoder
from jpaged.models.kv_pool import init_kv_pool
from jpaged.models.runner import ModelRunner

BLOCK_SIZE = 8


def _prefill_then_decode(runner: ModelRunner, spec, steps: int = 4):
    """Logits of one prefill and `steps` greedy decode steps over scattered tables, and the final pool."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, spec.vocab_size, n).tolist() for n in (13, 5, 21)]
    need = [-(-(len(p) + steps) // BLOCK_SIZE) for p in prompts]
    num_blocks = sum(need) + 3
    tables = scattered_tables(rng, need, num_blocks)
    pool = init_kv_pool(spec, num_blocks, BLOCK_SIZE)
    logits, pool = runner.step(pool, plan_from_contexts(prompts, [len(p) for p in prompts], tables, BLOCK_SIZE))
    all_logits = [np.asarray(logits)]
    contexts = [p + [int(t)] for p, t in zip(prompts, all_logits[-1].argmax(-1))]
    for _ in range(steps):
        logits, pool = runner.step(pool, plan_from_contexts(contexts, [1] * len(contexts), tables, BLOCK_SIZE))
        all_logits.append(np.asarray(logits))
        for ctx, t in zip(contexts, all_logits[-1].argmax(-1)):
            ctx.append(int(t))
    return all_logits, contexts, [np.asarray(p) for p in pool]


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
def test_per_layer_and_stacked_weights_give_identical_logits_tokens_and_cache(name):
    spec = get_preset(name)
    params = decoder.init_params(spec)
    stacked = ModelRunner(spec, params, block_size=BLOCK_SIZE, attention_backend="xla", per_layer_weights=False)
    per_layer = ModelRunner(spec, params, block_size=BLOCK_SIZE, attention_backend="xla", per_layer_weights=True)
    assert isinstance(per_layer.params["layers"], list) and len(per_layer.params["layers"]) == spec.num_layers
    logits_a, tokens_a, pool_a = _prefill_then_decode(stacked, spec)
    logits_b, tokens_b, pool_b = _prefill_then_decode(per_layer, spec)
    assert tokens_a == tokens_b
    # Same ops on the same values, only the weights' buffers differ: bit for bit on CPU with jax
    # 0.10-0.12.0. jax 0.12.1's XLA:CPU compiles the scanned LLaMA layer differently, moving the
    # last bits (up to 1.5e-7 in logits and cache values of magnitude 0.5; OPT still bit for bit).
    for a, b in zip(logits_a + pool_a, logits_b + pool_b):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_unstack_layers_slices_every_leaf_per_layer():
    spec = get_preset("tiny-llama")
    params = decoder.init_params(spec)
    per_layer = decoder.unstack_layers(params)
    assert len(per_layer) == spec.num_layers
    for i, layer in enumerate(per_layer):
        jax.tree.map(lambda s, x, i=i: np.testing.assert_array_equal(np.asarray(s)[i], np.asarray(x)),
                     params["layers"], layer)


def test_cpu_default_is_per_layer_and_the_step_slices_no_stacked_weight():
    """On CPU the runner unrolls over per-layer buffers: the compiled step has no dynamic-slice of a
    stacked [L, ...] weight (the copy the profile found), while the stacked layout's scan does."""
    spec = get_preset("tiny-opt")
    params = decoder.init_params(spec)
    runner = ModelRunner(spec, params, block_size=BLOCK_SIZE, attention_backend="xla")
    assert runner.per_layer_weights == (jax.default_backend() == "cpu")
    plan = plan_from_contexts([[3, 4, 5]], [1], [[1]], BLOCK_SIZE)
    pool = init_kv_pool(spec, 4, BLOCK_SIZE)
    one_layer_of_stacked_mlp = "f32[1,{},{}]".format(spec.hidden_size, spec.intermediate_size)  # [1, H, I]

    def sliced_weights(r):
        text = r.lower(pool, plan).compile().as_text()
        return [line for line in text.splitlines() if "dynamic-slice(" in line and one_layer_of_stacked_mlp in line]

    assert sliced_weights(ModelRunner(spec, params, block_size=BLOCK_SIZE, attention_backend="xla",
                                      per_layer_weights=True)) == []
    assert sliced_weights(ModelRunner(spec, params, block_size=BLOCK_SIZE, attention_backend="xla",
                                      per_layer_weights=False))


def test_a_mesh_keeps_the_stacked_layout():
    spec = get_preset("tiny-opt")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("tp",))
    with pytest.raises(ValueError, match="per_layer_weights"):
        ModelRunner(spec, decoder.init_params(spec), block_size=BLOCK_SIZE, mesh=mesh, per_layer_weights=True)
