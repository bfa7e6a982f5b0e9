"""Hugging Face model directories written from our parameters, for import tests (no network)."""

import json

import numpy as np
from safetensors.numpy import save_file

from jpaged.models.hf_names import hf_tensor_names


def write_hf_dir(directory, spec, params, config):
    """Writes params in Hugging Face naming and layout ([out, in] Linear weights, per-layer tensors)."""
    directory.mkdir()
    tensors = {}
    for path, (names, transposed) in hf_tensor_names(spec).items():
        leaf = np.asarray(params[path[0]][path[1]] if len(path) == 2 else params[path[0]][path[1]][path[2]])
        per_layer = list(leaf) if path[0] == "layers" else [leaf]
        for name, arr in zip(names, per_layer):
            tensors["model." + name] = np.ascontiguousarray(arr.T if transposed else arr)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return tensors


HF_CONFIGS = {
    "tiny-opt": {"model_type": "opt", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "ffn_dim": 256, "max_position_embeddings": 512,
                 "word_embed_proj_dim": 64, "do_layer_norm_before": True},
    "tiny-llama": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                   "intermediate_size": 128, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
                   "rope_theta": 10000.0, "tie_word_embeddings": False},
}
