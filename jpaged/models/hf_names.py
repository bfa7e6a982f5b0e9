"""Hugging Face layouts of OPT and LLaMA: specs from config.json, and tensor names per parameter.

`hf_tensor_names(spec)` maps every leaf of our parameter pytree to the Hugging Face tensor(s) that
fill it: one name per layer for stacked leaves, and whether the tensor is transposed (torch Linear
stores [out, in]; our kernels are [in, out]). Names are given without the leading "model." that
`*ForCausalLM` checkpoints add, since older OPT files omit it.
"""

from __future__ import annotations

import math
from typing import Any

from jpaged.config.presets import ModelSpec, RopeScaling

_MISSING = object()

# (param path inside a layer, HF name inside "layers.{i}.", transposed)
_OPT_LAYER = [
    (("attn_norm", "scale"), "self_attn_layer_norm.weight", False),
    (("attn_norm", "bias"), "self_attn_layer_norm.bias", False),
    *[((ours, part), f"self_attn.{theirs}_proj.{hf_part}", part == "kernel")
      for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "out"))
      for part, hf_part in (("kernel", "weight"), ("bias", "bias"))],
    (("mlp_norm", "scale"), "final_layer_norm.weight", False),
    (("mlp_norm", "bias"), "final_layer_norm.bias", False),
    *[((fc, part), f"{fc}.{hf_part}", part == "kernel")
      for fc in ("fc1", "fc2") for part, hf_part in (("kernel", "weight"), ("bias", "bias"))],
]
_LLAMA_LAYER = [
    (("attn_norm", "scale"), "input_layernorm.weight", False),
    *[((p, "kernel"), f"self_attn.{p}_proj.weight", True) for p in ("q", "k", "v", "o")],
    (("mlp_norm", "scale"), "post_attention_layernorm.weight", False),
    *[((p, "kernel"), f"mlp.{p}_proj.weight", True) for p in ("gate", "up", "down")],
]


def hf_tensor_names(spec: ModelSpec) -> dict[tuple[str, ...], tuple[list[str], bool]]:
    """Our param path -> (HF tensor names, one per layer for stacked leaves; transposed?)."""
    if spec.family == "opt":
        prefix, layer_table = "decoder.", _OPT_LAYER
        top = {("embed", "embedding"): "decoder.embed_tokens.weight",
               ("pos_embed", "embedding"): "decoder.embed_positions.weight",
               ("final_norm", "scale"): "decoder.final_layer_norm.weight",
               ("final_norm", "bias"): "decoder.final_layer_norm.bias"}
    else:
        prefix, layer_table = "", _LLAMA_LAYER
        top = {("embed", "embedding"): "embed_tokens.weight", ("final_norm", "scale"): "norm.weight"}
    names = {path: ([name], False) for path, name in top.items()}
    if not spec.tie_word_embeddings:
        names[("lm_head", "kernel")] = (["lm_head.weight"], True)
    for path, name, transposed in layer_table:
        names[("layers", *path)] = ([f"{prefix}layers.{i}.{name}" for i in range(spec.num_layers)], transposed)
    return names


def _int(config: dict, key: str, source: str, default: Any = _MISSING) -> int:
    """config[key] as a positive integer (JSON 64.0 or true are refused: they would load a wrong model)."""
    value = config.get(key, default)
    if value is _MISSING:
        raise ValueError(f"{source}: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {key} must be an integer >= 1, got {value!r}")
    return value


def _positive(config: dict, key: str, source: str, default: Any = _MISSING) -> float:
    """config[key] as a finite number > 0."""
    value = config.get(key, default)
    if value is _MISSING:
        raise ValueError(f"{source}: {key} is missing")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{source}: {key} must be a finite number > 0, got {value!r}")
    return float(value)


def _flag(config: dict, key: str, source: str, default: bool) -> bool:
    """config[key] as a boolean (default when absent)."""
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{source}: {key} must be true or false, got {value!r}")
    return value


def _require(config: dict, key: str, allowed: Any, source: str) -> None:
    value = config.get(key, allowed[0])
    if value not in allowed:
        raise ValueError(f"{source}: {key}={value!r} is not supported (allowed: {allowed})")


def _rope_parameters(config: dict, source: str) -> dict:
    """RoPE settings: transformers >= 5 keeps them in `rope_parameters`, older configs in
    `rope_scaling` (with "type" in the oldest) and a top-level `rope_theta`."""
    theta = config.get("rope_theta")
    rope = {"rope_theta": 10000.0 if theta is None else theta, **_mapping(config, "rope_scaling", source),
            **_mapping(config, "rope_parameters", source)}
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


def _mapping(config: dict, key: str, source: str) -> dict:
    value = config.get(key)
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise ValueError(f"{source}: {key} must be an object, got {value!r}")
    return value


def _rope_scaling(rope: dict, source: str) -> RopeScaling | None:
    """The spec's RopeScaling for "default" (None), "linear" and "llama3"; other kinds raise."""
    kind = rope["rope_type"]
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", _positive(rope, "factor", source))
    if kind == "llama3":
        return RopeScaling("llama3", _positive(rope, "factor", source), _positive(rope, "low_freq_factor", source),
                           _positive(rope, "high_freq_factor", source),
                           _int(rope, "original_max_position_embeddings", source))
    raise ValueError(f"{source}: rope_type={kind!r} is not supported (allowed: default, linear, llama3)")


def _spec(source: str, **fields: Any) -> ModelSpec:
    """ModelSpec(**fields); its own checks (heads against KV heads, RoPE's even head_dim) name `source`."""
    try:
        return ModelSpec(**fields)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def spec_from_hf_config(config: Any, name: str, source: str = "config.json") -> ModelSpec:
    """A ModelSpec from a Hugging Face OPT or LLaMA config.json mapping; unsupported variants and
    fields of the wrong type or range raise ValueError naming the key and `source`."""
    if not isinstance(config, dict):
        raise ValueError(f"{source}: must hold a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    heads, hidden = _int(config, "num_attention_heads", source), _int(config, "hidden_size", source)
    common = dict(name=name, vocab_size=_int(config, "vocab_size", source), hidden_size=hidden,
                  num_layers=_int(config, "num_hidden_layers", source), num_heads=heads,
                  max_position_embeddings=_int(config, "max_position_embeddings", source))
    if model_type == "opt":
        # opt-350m's post-norm layout and embedding projections are not implemented.
        _require(config, "do_layer_norm_before", [True], source)
        _require(config, "word_embed_proj_dim", [hidden], source)
        _require(config, "activation_function", ["relu"], source)
        _require(config, "enable_bias", [True], source)
        _require(config, "layer_norm_elementwise_affine", [True], source)
        if hidden % heads:
            raise ValueError(f"{source}: hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads})")
        return _spec(source, family="opt", num_kv_heads=heads, head_dim=hidden // heads,
                     intermediate_size=_int(config, "ffn_dim", source), norm_eps=1e-5,
                     tie_word_embeddings=_flag(config, "tie_word_embeddings", source, True), **common)
    if model_type == "llama":
        _require(config, "hidden_act", ["silu"], source)
        _require(config, "attention_bias", [False], source)
        _require(config, "mlp_bias", [False], source)
        rope = _rope_parameters(config, source)
        kv_heads = heads if config.get("num_key_value_heads") is None else _int(config, "num_key_value_heads", source)
        head_dim = hidden // heads if config.get("head_dim") is None else _int(config, "head_dim", source)
        return _spec(source, family="llama", num_kv_heads=kv_heads, head_dim=head_dim,
                     intermediate_size=_int(config, "intermediate_size", source),
                     norm_eps=_positive(config, "rms_norm_eps", source),
                     rope_theta=_positive(rope, "rope_theta", source, 10000.0),
                     rope_scaling=_rope_scaling(rope, source),
                     tie_word_embeddings=_flag(config, "tie_word_embeddings", source, False), **common)
    raise ValueError(f"{source}: model_type must be 'opt' or 'llama', got {model_type!r}")
