"""The asset model's architecture, in one place: config.json <-> ModelSpec, and jpaged's decoder.

Every use of jpaged.models by the language-model training lives here (a LLaMA-family ModelSpec
read from the config.json we write, `decoder.init_params`, `decoder.dense_forward`, and the
Hugging Face tensor names the importer reads), so a change of the model code is one file to port.
"""

from __future__ import annotations

from typing import Any

import jax
import ml_dtypes
import numpy as np

from jpaged.config.presets import ModelSpec
from jpaged.models import decoder
from jpaged.models.hf_names import hf_tensor_names, spec_from_hf_config

Params = decoder.Params
_STORE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def hf_config(*, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
              intermediate_size: int, max_position_embeddings: int, rms_norm_eps: float, rope_theta: float,
              bos_token_id: int, eos_token_id: int, pad_token_id: int, dtype: str) -> dict[str, Any]:
    """A LlamaForCausalLM config.json (tied embeddings, no biases, unscaled RoPE)."""
    if dtype not in _STORE_DTYPES:
        raise ValueError(f"dtype: must be one of {sorted(_STORE_DTYPES)}, got {dtype!r}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} must be a multiple of num_heads {num_heads}")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads, "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings, "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "mlp_bias": False, "tie_word_embeddings": True, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": bos_token_id, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id,
        "torch_dtype": dtype,
    }


def spec_of(config: dict[str, Any], name: str) -> ModelSpec:
    """The ModelSpec the project's importer builds from `config` (so training and serving agree)."""
    return spec_from_hf_config(config, name)


def init_params(spec: ModelSpec, seed: int) -> Params:
    """Seeded initial float32 parameters."""
    return decoder.init_params(spec, seed)


def forward(spec: ModelSpec, params: Params, tokens: jax.Array) -> jax.Array:
    """Dense causal forward: tokens i32[B, L] -> float32 logits [B, L, V]."""
    return decoder.dense_forward(spec, params, tokens)


def param_count(params: Params) -> int:
    """Scalars in `params` (tied LM head counted once)."""
    return decoder.param_count(params)


def flops_per_token(spec: ModelSpec, context: int) -> int:
    """Forward FLOPs of one token attending to `context` tokens: weight matmuls, LM head, QK^T and PV."""
    h = spec.hidden_size
    per_layer = 2 * h * spec.q_size + 2 * h * spec.kv_size + 3 * h * spec.intermediate_size
    return 2 * (spec.num_layers * per_layer + spec.vocab_size * h) + 4 * spec.num_layers * spec.q_size * context


def hf_tensors(spec: ModelSpec, params: Params, dtype: str) -> dict[str, np.ndarray]:
    """`params` as LlamaForCausalLM's safetensors tensors ("model.layers.0.self_attn.q_proj.weight", ...)."""
    out = {}
    for path, (names, transposed) in hf_tensor_names(spec).items():
        leaf = np.asarray(_get(params, path), dtype=np.float32)
        per_name = list(leaf) if path[0] == "layers" else [leaf]  # stacked leaves: one tensor per layer
        for name, value in zip(names, per_name, strict=True):
            key = name if name.startswith("lm_head.") else f"model.{name}"
            out[key] = np.ascontiguousarray(value.T if transposed else value).astype(_STORE_DTYPES[dtype])
    return out


def _get(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree
