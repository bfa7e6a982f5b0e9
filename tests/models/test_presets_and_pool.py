"""Preset sizes, KV pool layout and sizing, and the runner's argument checks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from experiments.paged_batch import plan_from_contexts
from jpaged.config.presets import get_preset, preset_names
from jpaged.models import decoder, layers
from jpaged.models.kv_pool import init_kv_pool, num_blocks_for_budget
from jpaged.models.runner import ModelRunner


def test_real_preset_sizes():
    # Parameter counts of the published checkpoints; KV bytes/token = 2 x layers x hidden x 2 B (fp16).
    assert get_preset("opt-125m").num_params() == 125_239_296
    assert get_preset("opt-13b").kv_bytes_per_token("float16") == 819_200  # the paper's 800 KB
    assert abs(get_preset("opt-13b").param_bytes("float16") / 1e9 - 25.7) < 0.1  # Table 1: 26 GB
    assert abs(get_preset("opt-175b").num_params() / 1e9 - 174.6) < 0.1
    assert abs(get_preset("llama-7b").num_params() / 1e9 - 6.74) < 0.01
    assert abs(get_preset("llama-13b").num_params() / 1e9 - 13.02) < 0.01
    assert get_preset("tiny-llama").num_kv_heads < get_preset("tiny-llama").num_heads  # GQA


def test_llama3_presets():
    # Parameter counts of meta-llama/Llama-3.2-1B (tied head), Llama-3.1-8B and -70B.
    assert get_preset("llama-3.2-1b").num_params() == 1_235_814_400
    assert get_preset("llama-3.1-8b").num_params() == 8_030_261_248
    assert get_preset("llama-3.1-70b").num_params() == 70_553_706_496
    spec = get_preset("llama-3.1-8b")
    assert (spec.rope_theta, spec.norm_eps, spec.rope_scaling.rope_type, spec.rope_scaling.factor) == (
        500000.0, 1e-5, "llama3", 8.0)


def test_llama3_rope_frequencies():
    """Kept above the high-frequency cutoff, divided by `factor` below the low one, blended between."""
    spec = get_preset("llama-3.1-8b")
    plain = layers.rope_frequencies(dataclasses.replace(spec, rope_scaling=None))
    scaled = layers.rope_frequencies(spec)
    wavelength = 2 * np.pi / plain
    high, low = wavelength < 8192 / 4, wavelength > 8192 / 1
    np.testing.assert_allclose(scaled[high], plain[high])
    np.testing.assert_allclose(scaled[low], plain[low] / 8, rtol=1e-6)
    middle = ~(high | low)
    assert middle.any() and np.all((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / 8))


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama", "tiny-copy"])
def test_num_params_matches_initialised_tree(name):
    spec = get_preset(name)
    assert decoder.param_count(decoder.init_params(spec)) == spec.num_params()


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="opt-13b.*llama-7b"):
        get_preset("gpt-2")
    assert {"opt-125m", "opt-66b", "llama-13b", "tiny-opt", "tiny-llama"} <= set(preset_names())


def test_kv_pool_layout_and_budget():
    spec = get_preset("tiny-llama")
    k, v = init_kv_pool(spec, num_blocks=10, block_size=16)
    assert k.shape == v.shape == (2, 2, 10, 16, 16)
    assert 10 * 16 * spec.kv_bytes_per_token("float32") == k.nbytes + v.nbytes
    block_bytes = 16 * spec.kv_bytes_per_token("float32")
    assert num_blocks_for_budget(k.nbytes + v.nbytes + 100, block_bytes, 16) == 10
    assert num_blocks_for_budget(-1, block_bytes, 16) == 0
    assert num_blocks_for_budget(2**62, block_bytes, 16) == 2**24  # MAX_BLOCKS
    # OPT-13B on an A100-40GB with 12 GB for the KV cache (Table 1): 15.7K slots.
    opt13 = get_preset("opt-13b")
    blocks = num_blocks_for_budget(12 * 1024**3, 16 * opt13.kv_bytes_per_token("float16"), 16)
    assert abs(blocks * 16 - 15_728) < 16


def test_runner_checks_pool_and_arrays():
    spec = get_preset("tiny-opt")
    runner = ModelRunner(spec, decoder.init_params(spec), block_size=16, attention_backend="xla")
    plan = plan_from_contexts([[5]], [1], [[1]], 16, shape=(1, 1, 1))
    with pytest.raises(ValueError, match="k_pool"):
        runner.step(init_kv_pool(spec, 4, 8), plan)
    with pytest.raises(ValueError, match="positions: expected int32"):
        runner.step(init_kv_pool(spec, 4, 16), dataclasses.replace(plan, positions=np.zeros(1, np.int64)))
    with pytest.raises(ValueError, match="attention_backend|backend"):
        ModelRunner(spec, {}, block_size=16, attention_backend="cuda")
