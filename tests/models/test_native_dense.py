"""The packed dense weights (jpaged.models.packed, the native CPU matrix multiply) in the real step:
the same greedy tokens and (up to summation order) logits as XLA's dots, tied and untied heads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jpaged.config.presets import get_preset
from jpaged.models import decoder, packed
from jpaged.models.runner import ModelRunner
from pallas_kernels import native_cpu, native_dense_cpu
from tests.models.test_per_layer_weights import BLOCK_SIZE, _prefill_then_decode

pytestmark = pytest.mark.skipif(not (native_cpu.available() and native_dense_cpu.available()),
                                reason=f"native CPU kernels: {native_dense_cpu.unavailable_reason()}")


@pytest.mark.parametrize("name,dtype", [("tiny-opt", "float32"), ("tiny-llama", "bfloat16")])
def test_packed_weights_give_the_xla_dots_tokens_and_logits(name, dtype):
    spec = get_preset(name)  # tiny-opt: tied head, biases; tiny-llama: untied head, GQA
    params = jax.tree.map(lambda x: x.astype(dtype), decoder.init_params(spec))
    plain = ModelRunner(spec, params, block_size=BLOCK_SIZE, attention_backend="cpu_native", native_dense=False)
    native = ModelRunner(spec, params, block_size=BLOCK_SIZE, attention_backend="cpu_native")
    assert native.native_dense and not plain.native_dense  # on by default with cpu_native
    kernels = [layer["q"]["kernel"] for layer in native.params["layers"]]
    assert all(native_dense_cpu.is_packed(k) for k in kernels)
    assert (packed.HEAD in native.params) == spec.tie_word_embeddings
    logits_a, tokens_a, _ = _prefill_then_decode(plain, spec)
    logits_b, tokens_b, _ = _prefill_then_decode(native, spec)
    assert tokens_a == tokens_b
    # float32: summation order only; bf16: activations re-rounded to bf16 after each layer too.
    tolerance = 1e-4 if dtype == "float32" else 2e-2
    for a, b in zip(logits_a, logits_b):  # [S, V]: the 3 sequences' rows, then padding
        assert np.abs(a[:3] - b[:3]).max() < tolerance * np.abs(a[:3]).max()
        assert not b[3:].any()  # the native head computes no padding row


def test_native_dense_needs_per_layer_weights_and_a_supported_dtype():
    spec = get_preset("tiny-opt")
    params = decoder.init_params(spec)
    with pytest.raises(ValueError, match="native_dense: packs the per-layer weights"):
        ModelRunner(spec, params, block_size=BLOCK_SIZE, per_layer_weights=False, native_dense=True)
    half = jax.tree.map(lambda x: x.astype(jnp.float16), params)
    assert not ModelRunner(spec, half, block_size=BLOCK_SIZE, attention_backend="xla").native_dense
    with pytest.raises(ValueError, match="float16"):
        ModelRunner(spec, half, block_size=BLOCK_SIZE, native_dense=True)
