"""experiments.lm.train_lm's parts: corpus split and chat examples, config checks, the HF export as the
exact inverse of the importer, and (slow) the whole command on a few files for a few steps."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments.lm import corpus, model, train_lm
from experiments.lm.train_lm import TrainLMConfig
from jpaged.models.checkpoint import import_hf
from jpaged.text.tokenizer import Tokenizer

SOURCE = '''class Box:
    def get(self, key, default=None):
        """Return the value for key.

        More detail here.
        """
        return self.data.get(key, default)

    def _private(self):
        """Skipped: private."""

def undocumented():
    pass
'''


def test_split_and_chat_examples():
    assert corpus.split(list(range(7)), 3) == ([1, 2, 4, 5], [0, 3, 6])
    with pytest.raises(ValueError, match="holdout_every"):
        corpus.split([1], 1)
    (example,) = corpus.chat_examples(SOURCE, max_chars=1000)
    assert example[0] == {"role": "user", "content": "Write a Python function `get(self, key, default=None)`. "
                                                      "Return the value for key."}
    assert example[1]["role"] == "assistant" and example[1]["content"].startswith("def get(self, key, default=None):")
    assert "\n    return self.data.get(key, default)" in example[1]["content"]  # dedented whole lines
    assert corpus.chat_examples(SOURCE, max_chars=20) == []
    assert corpus.chat_examples("def broken(:\n", 100) == []


def test_corpus_files_are_sorted_and_a_bad_glob_is_an_error():
    files = corpus.corpus_files("b*.py")
    assert [f.name for f in files] == sorted(f.name for f in files) and files
    with pytest.raises(ValueError, match="corpus_glob"):
        corpus.corpus_files("*.no-such-suffix")


@pytest.mark.parametrize("fields, message", [
    (dict(warmup_steps=10, steps=10, long_steps=0), "warmup_steps"),
    (dict(long_steps=11, steps=10, warmup_steps=1), "long_steps"),
    (dict(short_seq_len=600), "short_seq_len"),
    (dict(batch_size=3), "short_seq_len"),  # 3 * 256 tokens do not make whole 512-token windows
])
def test_config_errors_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainLMConfig(**fields)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_is_the_inverse_of_import_hf(tmp_path, dtype):
    hf = model.hf_config(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                            intermediate_size=48, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=1e4,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype=dtype)
    spec = model.spec_of(hf, "t")
    params = model.init_params(spec, seed=3)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    from safetensors.numpy import save_file
    save_file(model.hf_tensors(spec, params, dtype), str(tmp_path / "model.safetensors"))
    spec2, params2 = import_hf(tmp_path, name="t")
    assert spec2 == spec
    rtol = 0 if dtype == "float32" else 2 ** -8  # bfloat16 keeps 8 significant bits
    for path in (("embed", "embedding"), ("layers", "gate", "kernel"), ("layers", "o", "kernel")):
        want, got = params, params2
        for key in path:
            want, got = want[key], got[key]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol)


@pytest.mark.slow
def test_the_command_end_to_end_on_a_few_files(tmp_path):
    config = TrainLMConfig(corpus_glob="b*.py", holdout_every=4, vocab_size=300, hidden_size=32, num_layers=1,
                           num_heads=2, num_kv_heads=1, intermediate_size=64, seq_len=64, short_seq_len=32,
                           long_steps=1, steps=3, batch_size=4, warmup_steps=1, sample_tokens=4,
                           sample_prompts=("import os\n",), sample_chat=("hi",), output=str(tmp_path / "lm"))
    summary = train_lm.run(config)
    assert summary["heldout_loss"] > 0 and len(summary["samples"]) == 2
    record = json.loads((tmp_path / "lm" / "train_summary.json").read_text())
    assert record["provenance"]["corpus_files"] == 4 and len(record["provenance"]["corpus_sha256"]) == 64
    assert Tokenizer.from_dir(tmp_path / "lm").vocab_size == 300
    assert import_hf(tmp_path / "lm")[0].num_layers == 1
    assert not (tmp_path / "lm.partial").exists()
