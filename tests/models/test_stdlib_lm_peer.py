"""The asset model equals Hugging Face transformers' LlamaForCausalLM loaded from the same directory.

Skips without torch / transformers (the peer extra). Nothing is downloaded: transformers reads
assets/stdlib-lm (config.json, model.safetensors, generation_config.json) as `save_pretrained` wrote it.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="peer test needs torch (pip install torch==2.13.0)")
transformers = pytest.importorskip("transformers", reason="peer test needs transformers")

from experiments.lm.evaluate import greedy  # noqa: E402
from jpaged.models.checkpoint import import_hf  # noqa: E402
from jpaged.models.decoder import dense_forward  # noqa: E402
from jpaged.text.tokenizer import Tokenizer  # noqa: E402
from tests.helpers.text_assets import ASSET, SNIPPET  # noqa: E402


@pytest.fixture(scope="module")
def peer():
    # float32 on both sides: the stored bfloat16 weights upcast exactly, so logits must agree to rounding.
    return transformers.LlamaForCausalLM.from_pretrained(ASSET, dtype=torch.float32).eval()


def test_logits_equal_transformers(peer):
    spec, params = import_hf(ASSET)
    tok = Tokenizer.from_dir(ASSET)
    for text in (SNIPPET, "日本語 🙂 def f(x):\n    return x"):
        ids = np.asarray([tok.encode(text)], np.int32)
        with torch.no_grad():
            want = peer(torch.from_numpy(ids).long()).logits.numpy()
        got = np.asarray(dense_forward(spec, params, ids))
        assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-4


def test_greedy_generation_equals_transformers(peer):
    spec, params = import_hf(ASSET)
    tok = Tokenizer.from_dir(ASSET)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a Python function `is_even(n)`."}],
                                     add_generation_prompt=True, tokenize=True)
    assert peer.generation_config.eos_token_id == list(tok.eos_token_ids)
    with torch.no_grad():
        out = peer.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)[0, len(prompt):].tolist()
    ours = greedy(spec, params, [prompt], 32, stop_ids=tok.eos_token_ids, seq_len=128)[0]
    # transformers pads past its EOS; ours stops after the EOS token.
    assert out[:len(ours)] == ours


def test_prompt_logprobs_equal_transformers(peer):
    """LLM.generate's prompt log-probabilities, in chunks of 8 tokens, equal transformers' log-softmax."""
    from jpaged import LLM, SamplingParams

    # The pool and limits of the other asset-model tests (their programs are compiled already), and
    # no warm-up grid: only the programs this run takes.
    llm = LLM(str(ASSET), num_blocks=128, block_size=16, max_num_seqs=16, attention_backend="xla",
              long_prefill_token_threshold=8, warmup=False)
    texts = [SNIPPET, "日本語 🙂 def f(x):\n    return x"]
    outs = llm.generate(texts, SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    for out in outs:
        ids = out.prompt_token_ids
        with torch.no_grad():
            want = torch.log_softmax(peer(torch.tensor([ids])).logits[0], dim=-1).numpy()  # [len, V]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for t in range(1, len(ids)):
            entry = out.prompt_logprobs[t]
            np.testing.assert_allclose(entry[ids[t]], want[t - 1, ids[t]], atol=1e-4)
            top = np.argsort(-want[t - 1])[:5]
            np.testing.assert_allclose([entry[int(i)] for i in top], want[t - 1, top], atol=1e-4)
