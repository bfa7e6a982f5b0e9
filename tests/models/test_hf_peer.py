"""Equivalence with Hugging Face transformers: same random weights, same tokens, same logits.

Skips when torch or transformers is missing (CI installs both; locally: pip install torch==2.13.0
transformers). Models are built from configs with random weights: nothing is downloaded.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="peer test needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="peer test needs transformers")

from jpaged.models.checkpoint import import_hf  # noqa: E402
from jpaged.models.decoder import dense_forward  # noqa: E402

PEERS = {
    "opt": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=256,
        max_position_embeddings=512, word_embed_proj_dim=64, init_std=0.1, dropout=0.0)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=512, initializer_range=0.1,
        tie_word_embeddings=False)),
    # Llama 3.1's layout: tied head, rms eps and rope theta off the defaults, "llama3" RoPE scaling
    # (a 64-token pre-training context so that head_dim 16 has kept, blended and stretched frequencies).
    "llama3": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, max_position_embeddings=512, initializer_range=0.1,
        tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    "llama-linear-rope": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=128, max_position_embeddings=512, initializer_range=0.1, rope_theta=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0})),
}


@pytest.mark.parametrize("family", list(PEERS))
def test_logits_match_transformers(tmp_path, family):
    torch.manual_seed(0)
    model = PEERS[family]().eval()
    model.save_pretrained(tmp_path / family)
    spec, params = import_hf(tmp_path / family)
    tokens = np.random.default_rng(0).integers(0, 256, (2, 40)).astype(np.int32)
    with torch.no_grad():
        want = model(torch.from_numpy(tokens).long()).logits.numpy()
    got = np.asarray(dense_forward(spec, params, tokens))
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-4
