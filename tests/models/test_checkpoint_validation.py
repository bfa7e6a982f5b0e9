"""Hostile weights: every malformed Hugging Face directory or orbax checkpoint is refused with a
ValueError naming the file and the key or tensor, never a crash, never a silently wrong model —
table-driven cases and a fuzz of the safetensors bytes and config.json values."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.core.sequence import SamplingParams
from jpaged.engine import LLMEngine
from jpaged.models import decoder
from jpaged.models.checkpoint import import_hf, restore_params, save_params
from tests.helpers.hf_dirs import HF_CONFIGS, write_hf_dir

ASSETS = Path(__file__).resolve().parents[2] / "assets"
NAME = "tiny-llama"
SPEC = get_preset(NAME)
PARAMS = decoder.init_params(SPEC, seed=5)


@pytest.fixture(scope="module")
def good_hf(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "good"
    tensors = write_hf_dir(directory, SPEC, PARAMS, HF_CONFIGS[NAME])
    return directory, tensors


def _copy(good, tmp_path):
    directory = tmp_path / "hf"
    shutil.copytree(good, directory)
    return directory


def _config(directory, **changes):
    config = json.loads((directory / "config.json").read_text()) | changes
    (directory / "config.json").write_text(json.dumps(config))


def _retype(directory, tensors, name, dtype):
    save_file({**tensors, name: tensors[name].astype(dtype)}, str(directory / "model.safetensors"))


K_PROJ = "model.layers.1.self_attn.k_proj.weight"
HF_CASES = [  # (id, corruption, pattern the message must match)
    ("int32-tensor", lambda d, t: _retype(d, t, K_PROJ, np.int32), r"model\.safetensors: tensor .*k_proj.* dtype I32"),
    ("bool-tensor", lambda d, t: _retype(d, t, K_PROJ, np.bool_), r"model\.safetensors: tensor .*k_proj.* dtype BOOL"),
    ("float-hidden-size", lambda d, t: _config(d, hidden_size=64.0), r"config\.json: hidden_size must be an integer"),
    ("bool-heads", lambda d, t: _config(d, num_attention_heads=True), r"config\.json: num_attention_heads must be"),
    ("string-layers", lambda d, t: _config(d, num_hidden_layers="2"), r"config\.json: num_hidden_layers must be"),
    ("zero-vocab", lambda d, t: _config(d, vocab_size=0), r"config\.json: vocab_size must be an integer >= 1"),
    ("missing-vocab", lambda d, t: _drop(d, "vocab_size"), r"config\.json: vocab_size is missing"),
    ("nan-eps", lambda d, t: _config(d, rms_norm_eps=float("nan")), r"config\.json: rms_norm_eps must be a finite"),
    ("string-theta", lambda d, t: _config(d, rope_theta="1e4"), r"config\.json: rope_theta must be a finite"),
    ("list-rope-scaling", lambda d, t: _config(d, rope_scaling=[2.0]), r"config\.json: rope_scaling must be an object"),
    ("string-tie", lambda d, t: _config(d, tie_word_embeddings="yes"), r"tie_word_embeddings must be true or false"),
    ("kv-heads-above-heads", lambda d, t: _config(d, num_attention_heads=1),
     r"config\.json: num_heads \(1\) must be a multiple of num_kv_heads"),
    ("odd-rope-head-dim", lambda d, t: _config(d, head_dim=1), r"config\.json: llama family needs an even head_dim"),
    ("unknown-model-type", lambda d, t: _config(d, model_type="gpt2"), r"model_type must be 'opt' or 'llama'"),
    ("bad-json", lambda d, t: (d / "config.json").write_text("{\"vocab_size\": 256,"), r"config\.json: not valid JSON"),
    ("json-list", lambda d, t: (d / "config.json").write_text("[1, 2]"), r"config\.json: must hold a JSON object"),
    ("binary-config", lambda d, t: (d / "config.json").write_bytes(b"\xff\xfe\x00"), r"config\.json: not valid JSON"),
    ("truncated", lambda d, t: _truncate(d, 0.6), r"model\.safetensors: not a readable safetensors file"),
    ("header-length", lambda d, t: _patch(d, 0, b"\xff" * 8), r"model\.safetensors: not a readable safetensors file"),
    ("header-json", lambda d, t: _patch(d, 8, b"[[["), r"model\.safetensors: not a readable safetensors file"),
    ("empty-file", lambda d, t: (d / "model.safetensors").write_bytes(b""), r"not a readable safetensors file"),
    ("misshaped", lambda d, t: save_file({**t, K_PROJ: np.zeros((16, 64), np.float32)},
                                         str(d / "model.safetensors")), r"tensor .*k_proj.* has shape \[16, 64\]"),
    ("missing-tensor", lambda d, t: save_file({k: v for k, v in t.items() if k != K_PROJ},
                                              str(d / "model.safetensors")), r"tensor .*k_proj.* is missing"),
    ("no-weights", lambda d, t: (d / "model.safetensors").unlink(), r"no \*\.safetensors files"),
]


def _drop(directory, key):
    config = json.loads((directory / "config.json").read_text())
    config.pop(key)
    (directory / "config.json").write_text(json.dumps(config))


def _truncate(directory, fraction):
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * fraction)])


def _patch(directory, offset, patch):
    path = directory / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[offset: offset + len(patch)] = patch
    path.write_bytes(bytes(data))


def _serve(checkpoint) -> list[int]:
    """Greedy tokens of an engine on `checkpoint`; its pool must come back whole."""
    config = EngineConfig(model=ModelConfig(name=NAME, checkpoint=str(checkpoint), attention_backend="xla"),
                          cache=CacheConfig(block_size=8, num_blocks=32, num_host_blocks=0),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64))
    engine = LLMEngine(config)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4), use_tqdm=False)[0]
    assert engine.kv_stats()["num_free_blocks"] == engine.kv_stats()["num_total_blocks"]
    return out.output_token_ids[0]


@pytest.fixture(scope="module")
def good_tokens(good_hf):
    return _serve(good_hf[0])


@pytest.mark.parametrize("case", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_malformed_hugging_face_directories_are_refused(good_hf, tmp_path, case):
    good, tensors = good_hf
    _, corrupt, pattern = case
    directory = _copy(good, tmp_path)
    corrupt(directory, tensors)
    with pytest.raises(ValueError, match=pattern) as info:
        import_hf(directory, name=NAME)
    assert str(directory) in str(info.value)  # the message names the directory or file
    with pytest.raises(ValueError, match=pattern):  # through the engine's own entry, as a user meets it
        _serve(directory)


def test_a_good_model_is_served_exactly_after_the_refusals(good_hf, good_tokens, tmp_path):
    good, tensors = good_hf
    for i, (_, corrupt, _) in enumerate(HF_CASES):  # every refusal again, in one process, then the good one
        directory = _copy(good, tmp_path / str(i))
        corrupt(directory, tensors)
        with pytest.raises(ValueError):
            import_hf(directory, name=NAME)
    assert _serve(good) == good_tokens


def _rewrite_metadata(checkpoint, change):
    path = checkpoint / "metadata" / "metadata"
    meta = json.loads(path.read_text())
    change(meta)
    path.write_text(json.dumps(meta))


ORBAX_CASES = [
    ("int8-dtype", lambda m: m.update(dtype="int8"), r"metadata dtype must be one of float32, bfloat16, float16"),
    ("float-hidden-size", lambda m: m["spec"].update(hidden_size=64.0), r"metadata spec: hidden_size must be an integer"),
    ("unknown-spec-field", lambda m: m["spec"].update(colour="red"), r"metadata spec: .*colour"),
    ("missing-spec-field", lambda m: m["spec"].pop("num_layers"), r"metadata spec: .*num_layers"),
    ("spec-not-object", lambda m: m.update(spec=[1]), r"metadata must be an object with a 'spec' object"),
    ("nan-eps", lambda m: m["spec"].update(norm_eps=float("nan")), r"metadata spec: norm_eps must be a finite"),
]


@pytest.mark.parametrize("case", ORBAX_CASES, ids=[c[0] for c in ORBAX_CASES])
def test_malformed_orbax_metadata_is_refused(tmp_path, case):
    _, change, pattern = case
    save_params(tmp_path / "ckpt", SPEC, PARAMS)
    _rewrite_metadata(tmp_path / "ckpt", change)
    with pytest.raises(ValueError, match=pattern) as info:
        restore_params(tmp_path / "ckpt")
    assert str(tmp_path / "ckpt") in str(info.value)


def test_a_folder_that_is_not_a_checkpoint_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty: not a checkpoint written by save_params"):
        restore_params(tmp_path / "empty")


def test_a_corrupt_metadata_file_is_named_and_called_unreadable(tmp_path):
    checkpoint = tmp_path / "tiny-copy"
    shutil.copytree(ASSETS / "tiny-copy", checkpoint)
    (checkpoint / "metadata" / "metadata").write_text("{oops")
    with pytest.raises(ValueError) as info:
        restore_params(checkpoint)
    message = str(info.value)
    assert message.startswith(f"{checkpoint / 'metadata' / 'metadata'}: the checkpoint's metadata file is unreadable")
    assert "JSONDecodeError" in message and "not a checkpoint" not in message


def _same_model(params) -> bool:
    return all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree_util.tree_leaves(PARAMS), jax.tree_util.tree_leaves(params)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["truncate", "header", "config"]), data=st.data())
def test_fuzzed_weights_give_a_clear_error_or_the_same_model(good_hf, tmp_path_factory, kind, data):
    good, _ = good_hf
    directory = _copy(good, tmp_path_factory.mktemp("fuzz"))
    weights = directory / "model.safetensors"
    raw = weights.read_bytes()
    header_len = 8 + int.from_bytes(raw[:8], "little")
    if kind == "truncate":
        weights.write_bytes(raw[: data.draw(st.integers(0, len(raw) - 1))])
    elif kind == "header":  # bytes of the length prefix or the JSON header
        start = data.draw(st.integers(0, header_len - 1))
        _patch(directory, start, data.draw(st.binary(min_size=1, max_size=8)))
    else:
        junk = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=5),
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                        max_size=3), max_leaves=6)
        key = data.draw(st.sampled_from(sorted(HF_CONFIGS[NAME]) + ["rope_scaling"]))
        value = data.draw(junk)
        config = json.loads((directory / "config.json").read_text())
        config[key] = value
        (directory / "config.json").write_text(json.dumps(config))
    try:
        spec, params = import_hf(directory, name=NAME)
    except ValueError as exc:
        assert str(directory) in str(exc)
        return
    if kind == "config":  # a junk value that loads must have been a well-typed value for its key
        assert _well_typed(key, value), f"config.json {key}={value!r} loaded as {spec}"
    else:  # corrupted bytes that load must have been immaterial: the very same model
        assert spec == SPEC and _same_model(params), f"{kind}: a corrupted directory loaded a different model"


def _well_typed(key, value) -> bool:
    if key == "rope_theta" and value is None:  # absent: the default
        return True
    if key in ("rms_norm_eps", "rope_theta"):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value) and value > 0
    if key == "tie_word_embeddings":
        return isinstance(value, bool)
    if key == "rope_scaling":
        return value is None or value == {} or (isinstance(value, dict) and value.get("rope_type", "default") in
                                                ("default", None))
    if key == "model_type":
        return value == "llama"
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1 or (
        key in ("num_key_value_heads", "head_dim") and value is None)
