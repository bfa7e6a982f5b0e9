"""Hugging Face layouts of OPT and LLaMA: specs from config.json, and tensor names per parameter.

`hf_tensor_names(spec)` maps every leaf of our parameter pytree to the Hugging Face tensor(s) that
fill it: one name per layer for stacked leaves, and whether the tensor is transposed (torch Linear
stores [out, in]; our kernels are [in, out]). Names are given without the leading "model." that
`*ForCausalLM` checkpoints add, since older OPT files omit it.
"""

from __future__ import annotations

from typing import Any

from jpaged.models.presets import ModelSpec, RopeScaling

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


def _require(config: dict, key: str, allowed: Any, source: str) -> None:
    value = config.get(key, allowed[0])
    if value not in allowed:
        raise ValueError(f"{source}: {key}={value!r} is not supported (allowed: {allowed})")


def _rope_parameters(config: dict) -> dict:
    """RoPE settings: transformers >= 5 keeps them in `rope_parameters`, older configs in
    `rope_scaling` (with "type" in the oldest) and a top-level `rope_theta`."""
    rope = {"rope_theta": config.get("rope_theta") or 10000.0, **(config.get("rope_scaling") or {}),
            **(config.get("rope_parameters") or {})}
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


def _rope_scaling(rope: dict, source: str) -> RopeScaling | None:
    """The spec's RopeScaling for "default" (None), "linear" and "llama3"; other kinds raise."""
    kind = rope["rope_type"]
    if kind == "default":
        return None
    if kind == "linear":
        return RopeScaling("linear", float(rope["factor"]))
    if kind == "llama3":
        return RopeScaling("llama3", float(rope["factor"]), float(rope["low_freq_factor"]),
                           float(rope["high_freq_factor"]), int(rope["original_max_position_embeddings"]))
    raise ValueError(f"{source}: rope_type={kind!r} is not supported (allowed: default, linear, llama3)")


def spec_from_hf_config(config: dict, name: str, source: str = "config.json") -> ModelSpec:
    """A ModelSpec from a Hugging Face OPT or LLaMA config.json mapping; unsupported variants raise."""
    model_type = config.get("model_type")
    heads, hidden = config["num_attention_heads"], config["hidden_size"]
    common = dict(name=name, vocab_size=config["vocab_size"], hidden_size=hidden,
                  num_layers=config["num_hidden_layers"], num_heads=heads,
                  max_position_embeddings=config["max_position_embeddings"])
    if model_type == "opt":
        # opt-350m's post-norm layout and embedding projections are not implemented.
        _require(config, "do_layer_norm_before", [True], source)
        _require(config, "word_embed_proj_dim", [hidden], source)
        _require(config, "activation_function", ["relu"], source)
        _require(config, "enable_bias", [True], source)
        _require(config, "layer_norm_elementwise_affine", [True], source)
        return ModelSpec(family="opt", num_kv_heads=heads, head_dim=hidden // heads,
                         intermediate_size=config["ffn_dim"], norm_eps=1e-5,
                         tie_word_embeddings=config.get("tie_word_embeddings", True), **common)
    if model_type == "llama":
        _require(config, "hidden_act", ["silu"], source)
        _require(config, "attention_bias", [False], source)
        _require(config, "mlp_bias", [False], source)
        rope = _rope_parameters(config)
        return ModelSpec(family="llama", num_kv_heads=config.get("num_key_value_heads") or heads,
                         head_dim=config.get("head_dim") or hidden // heads,
                         intermediate_size=config["intermediate_size"], norm_eps=config["rms_norm_eps"],
                         rope_theta=float(rope.get("rope_theta", 10000.0)), rope_scaling=_rope_scaling(rope, source),
                         tie_word_embeddings=config.get("tie_word_embeddings", False), **common)
    raise ValueError(f"{source}: model_type must be 'opt' or 'llama', got {model_type!r}")
