"""Tensor-parallel configuration on one device: divisibility errors naming the numbers, the
Megatron partition specs, and KV-head replication leaving the model's outputs unchanged."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jpaged.config import ModelConfig
from jpaged.config.presets import get_preset
from jpaged.models import decoder, parallel


@pytest.mark.parametrize("name,tp,match", [
    ("tiny-opt", 3, "num_heads 4 is not divisible by tensor_parallel_size 3"),
    ("tiny-llama", 8, "num_heads 4 is not divisible by tensor_parallel_size 8"),
    ("opt-13b", 16, "num_heads 40 is not divisible by tensor_parallel_size 16"),
])
def test_config_rejects_indivisible_heads(name, tp, match):
    with pytest.raises(ValueError, match=f"model.tensor_parallel_size: {name}: {match}"):
        ModelConfig(name=name, tensor_parallel_size=tp)


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="model.tensor_parallel_size: must be >= 1"):
        ModelConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="model.coordinator_address"):
        ModelConfig(num_processes=2, process_id=1)
    with pytest.raises(ValueError, match=r"model.process_id: must be in \[0, 2\)"):
        ModelConfig(num_processes=2, process_id=2, coordinator_address="10.0.0.1:1234")
    # The paper's setups: OPT-66B on 4 GPUs, OPT-175B on 8; LLaMA-13B on 8.
    for name, tp in (("opt-66b", 4), ("opt-175b", 8), ("llama-13b", 8)):
        ModelConfig(name=name, tensor_parallel_size=tp)


def test_kv_heads_must_divide_or_be_divided():
    spec = get_preset("tiny-llama")  # 4 query heads, 2 KV heads
    spec.check_tensor_parallel(4)  # replicated
    odd = dataclasses.replace(spec, name="odd", num_heads=6, num_kv_heads=3)
    with pytest.raises(ValueError, match="num_kv_heads 3 and tensor_parallel_size 2"):
        odd.check_tensor_parallel(2)


def test_megatron_partition_specs():
    specs = parallel.param_partition_specs(get_preset("tiny-llama"), 4)
    layers = specs["layers"]
    assert layers["q"]["kernel"] == layers["gate"]["kernel"] == layers["up"]["kernel"] == P(None, None, "tp")
    assert layers["o"]["kernel"] == layers["down"]["kernel"] == P(None, "tp", None)
    assert layers["attn_norm"]["scale"] == specs["final_norm"]["scale"] == P()
    assert specs["embed"]["embedding"] == P("tp", None) and specs["lm_head"]["kernel"] == P(None, "tp")
    opt = parallel.param_partition_specs(get_preset("tiny-opt"), 2)["layers"]
    assert opt["fc1"]["bias"] == P(None, "tp") and opt["fc2"]["bias"] == P() and opt["o"]["bias"] == P()


def test_replicated_kv_heads_leave_the_model_unchanged():
    spec = get_preset("tiny-llama")
    params = decoder.init_params(spec, seed=3)
    wide_spec, wide = parallel.replicate_kv_heads(spec, params, 4)
    assert wide_spec.num_kv_heads == 4 and wide["layers"]["k"]["kernel"].shape[-1] == 4 * spec.head_dim
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 256, (2, 11)), jnp.int32)
    np.testing.assert_allclose(decoder.dense_forward(wide_spec, wide, tokens),
                               decoder.dense_forward(spec, params, tokens), rtol=1e-5, atol=1e-5)
    assert parallel.replicate_kv_heads(spec, params, 2) == (spec, params)


def test_single_device_mesh():
    mesh = parallel.make_mesh(1)
    assert mesh.shape == {"tp": 1} and mesh.devices.ravel()[0] == jax.devices()[0]
