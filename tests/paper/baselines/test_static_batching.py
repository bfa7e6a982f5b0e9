"""The static-batching baseline decodes exactly what the dense model decodes."""

import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.config.presets import get_preset
from jpaged.models import decoder
from jpaged.paper.baselines.static_batching import StaticBatchGenerator
from tests.helpers.tiny_engines import dense_greedy


def test_static_batching_matches_dense_greedy():
    spec = get_preset("tiny-opt")
    params = decoder.init_params(spec, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, size=n).tolist() for n in (3, 8, 9, 17, 30)]
    max_tokens = [5, 9, 2, 9, 7]
    gen = StaticBatchGenerator(spec, params, jnp.float32)
    outputs, _ = gen.generate(prompts, max_tokens, batch_size=2)
    expected = dense_greedy("tiny-opt", prompts, 9)
    assert outputs == [e[:m] for e, m in zip(expected, max_tokens)]
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        gen.generate(prompts, max_tokens, batch_size=0)
