"""The draft-model options of experiments.lm.train_lm: a shared tokenizer copied or refused, the
distillation fields checked, and the greedy agreement with its speculative-decoding replay."""

from __future__ import annotations

import numpy as np
import pytest

from experiments.lm import evaluate, model, train_lm
from experiments.lm.train_lm import TrainLMConfig
from tests.helpers.text_assets import ASSET


@pytest.mark.parametrize("fields, message", [
    (dict(distill_weight=0.5), "distill_from"),
    (dict(distill_from="x", distill_weight=1.5), "distill_weight"),
    (dict(distill_from="x", agreement_prompt_tokens=500), "agreement_prompt_tokens"),
    (dict(speculative_k=0), "speculative_k"),
])
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainLMConfig(**fields)


def test_shared_tokenizer_is_copied_byte_for_byte_and_a_different_one_refused(tmp_path):
    train_lm._copy_tokenizer(ASSET, tmp_path / "draft")
    for name in train_lm.TOKENIZER_FILES:
        assert (tmp_path / "draft" / name).read_bytes() == (ASSET / name).read_bytes()
    with pytest.raises(ValueError, match="tokenizer_from: .* has no tokenizer.json"):
        train_lm._copy_tokenizer(tmp_path / "nothing", tmp_path / "other")
    (tmp_path / "draft" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="distill_from: .*differs"):
        train_lm._load_teacher(TrainLMConfig(distill_from=str(ASSET)), tmp_path / "draft")


def test_tokens_per_verify_step_replays_greedy_speculation():
    hits = [np.array([1, 1, 0, 1, 1, 1, 1, 1, 0], bool)]
    # k=4: accept 2 + the target's token (3), accept 4 + the target's (5), the last hit ends it (1).
    assert evaluate.tokens_per_verify_step(hits, 4) == 9 / 3
    assert evaluate.tokens_per_verify_step([np.zeros(5, bool)], 4) == 1.0  # no speculation gain


@pytest.mark.slow  # two compiles of the decoder
def test_a_model_agrees_with_itself():
    hf = model.hf_config(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                         intermediate_size=48, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=1e4,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32")
    spec = model.spec_of(hf, "t")
    params = model.init_params(spec, seed=0)
    got = evaluate.greedy_agreement(spec, params, spec, params, [[1, 5, 7], [1, 9]], 9, stop_ids=(), k=4)
    assert got["greedy_agreement"] == 1.0 and got["agreement_positions"] == 18
    assert got["greedy_tokens_per_verify_step_k4"] == 4.5 and got["iid_tokens_per_verify_step_k4"] == 5.0
    weights = 2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 48 + 64 * 32  # q, o; k, v; SwiGLU; tied LM head
    assert model.flops_per_token(spec, context=10) == 2 * weights + 4 * 32 * 10


@pytest.mark.parametrize("fields, message", [
    (dict(target_sequences=4), "target_sequences: > 0 needs distill_from"),
    (dict(distill_from="x", target_sequences=4, target_tokens=0), "target_tokens"),
    (dict(distill_from="x", target_window_share=1.0), "target_window_share"),
])
def test_self_distillation_fields_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainLMConfig(**fields)


@pytest.mark.slow  # an engine of the asset model and a dense decode of it
def test_the_targets_continuations_are_its_greedy_decode():
    config = TrainLMConfig(distill_from=str(ASSET), target_sequences=3, target_prompt_tokens=6, target_tokens=5)
    stream = np.arange(100, 160, dtype=np.int32)
    generated = train_lm._target_continuations(config, stream, vocab_size=4096).reshape(3, 11)
    windows, random_prompt = generated[:1, :6], generated[1:, :6]
    assert (windows - windows[:, :1] == np.arange(6)).all() and windows[0, 0] >= 100  # a window of the stream
    assert not np.isin(random_prompt, stream).all()  # uniformly random ids: not all from the stream's 60
    spec, params = train_lm._load_teacher(config, ASSET)
    dense = evaluate.greedy(spec, params, generated[:, :6].tolist(), 5, (), 11)
    assert generated[:, 6:].tolist() == dense
