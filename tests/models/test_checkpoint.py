"""Weights: orbax round trip, dummy loading, and Hugging Face safetensors import with clear errors."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jpaged.config import ModelConfig
from jpaged.config.presets import RopeScaling, get_preset
from jpaged.models import decoder
from jpaged.models.checkpoint import import_hf, load_params, resolve_dtype, restore_params, save_params
from tests.helpers.hf_dirs import HF_CONFIGS, write_hf_dir


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_orbax_round_trip_is_bit_exact(tmp_path, dtype):
    spec = get_preset("tiny-llama")
    params = decoder.init_params(spec, seed=3, dtype=dtype)
    save_params(tmp_path / "ckpt", spec, params, metadata={"note": "test"})
    spec2, restored, meta = restore_params(tmp_path / "ckpt")
    assert spec2 == spec and meta["note"] == "test"
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(restored)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def test_load_params_dummy_is_seeded_and_checks_checkpoint_name(tmp_path):
    spec, p1 = load_params(ModelConfig(name="tiny-opt", seed=7))
    _, p2 = load_params(ModelConfig(name="tiny-opt", seed=7))
    assert decoder.param_count(p1) == spec.num_params()
    np.testing.assert_array_equal(p1["embed"]["embedding"], p2["embed"]["embedding"])
    save_params(tmp_path / "ckpt", spec, p1)
    with pytest.raises(ValueError, match="does not match"):
        load_params(ModelConfig(name="tiny-llama", checkpoint=str(tmp_path / "ckpt")))


@pytest.mark.parametrize("name", ["tiny-opt", "tiny-llama"])
def test_import_hf_directory(tmp_path, name):
    spec = get_preset(name)
    params = decoder.init_params(spec, seed=5)
    write_hf_dir(tmp_path / "hf", spec, params, HF_CONFIGS[name])
    imported_spec, imported = import_hf(tmp_path / "hf", name=name)
    assert imported_spec == spec
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(imported)):
        np.testing.assert_array_equal(a, b)
    _, via_config = load_params(ModelConfig(name=name, checkpoint=str(tmp_path / "hf")))
    np.testing.assert_array_equal(via_config["embed"]["embedding"], params["embed"]["embedding"])


def test_import_hf_names_misshaped_and_missing_tensors(tmp_path):
    spec = get_preset("tiny-llama")
    tensors = write_hf_dir(tmp_path / "hf", spec, decoder.init_params(spec), HF_CONFIGS["tiny-llama"])
    bad = "model.layers.1.self_attn.k_proj.weight"
    save_file({**tensors, bad: np.zeros((16, 64), np.float32)}, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_proj\.weight has shape \[16, 64\], expected \[32, 64\]"):
        import_hf(tmp_path / "hf")
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tensor norm\.weight is missing"):
        import_hf(tmp_path / "hf")


def test_import_hf_rejects_unsupported_variant(tmp_path):
    spec = get_preset("tiny-opt")
    config = {**HF_CONFIGS["tiny-opt"], "do_layer_norm_before": False}  # opt-350m's post-norm layout
    write_hf_dir(tmp_path / "hf", spec, decoder.init_params(spec), config)
    with pytest.raises(ValueError, match="do_layer_norm_before"):
        import_hf(tmp_path / "hf")


def test_spec_with_rope_scaling_round_trips_and_dtype_converts_on_restore(tmp_path):
    spec = dataclasses.replace(get_preset("tiny-llama"), rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64))
    params = decoder.init_params(spec, seed=1)
    save_params(tmp_path / "ckpt", spec, params)
    spec2, restored, meta = restore_params(tmp_path / "ckpt", dtype=jnp.bfloat16)
    assert spec2 == spec and meta["dtype"] == "float32"
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(restored)):
        assert b.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.bfloat16)), np.asarray(b))


def test_import_hf_reads_llama3_rope_eps_and_theta(tmp_path):
    spec = get_preset("tiny-llama")
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    config = {**HF_CONFIGS["tiny-llama"], "rms_norm_eps": 1e-5, "rope_parameters": rope}
    del config["rope_theta"]
    write_hf_dir(tmp_path / "hf", spec, decoder.init_params(spec), config)
    imported, _ = import_hf(tmp_path / "hf")
    assert imported.rope_scaling == RopeScaling("llama3", 32.0, 1.0, 4.0, 8192)
    assert (imported.norm_eps, imported.rope_theta) == (1e-5, 500000.0)
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "rope_parameters": {"rope_type": "yarn"}}))
    with pytest.raises(ValueError, match="rope_type='yarn' is not supported"):
        import_hf(tmp_path / "hf")


def test_dtype_auto_is_bfloat16_on_accelerators(monkeypatch):
    assert ModelConfig().dtype == "auto"
    assert resolve_dtype("auto") == jnp.float32  # this CPU
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert resolve_dtype("auto") == jnp.bfloat16
    assert resolve_dtype("float16") == jnp.float16
