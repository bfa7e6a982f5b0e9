"""Our tokenizer front end equals transformers' on the same files: ids, text, chat prompts.

Skips without transformers (the peer extra). transformers reads the same local directory; nothing
is downloaded.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers", reason="peer test needs transformers")

from jpaged.text.tokenizer import Tokenizer  # noqa: E402
from tests.helpers.text_assets import ASSET, REAL_TEXTS, sentencepiece_like  # noqa: E402


@pytest.fixture(scope="module")
def hf_tok():
    return transformers.AutoTokenizer.from_pretrained(ASSET)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=80) | st.sampled_from(REAL_TEXTS), special=st.booleans())
def test_encode_equals_transformers(tok, hf_tok, text, special):
    assert tok.encode(text, add_special_tokens=special) == hf_tok.encode(text, add_special_tokens=special)


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 4095), max_size=30), skip=st.booleans())
def test_decode_equals_transformers(tok, hf_tok, ids, skip):
    assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": "Write a Python function `f(x)`."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "日本語 🙂"},
     {"role": "assistant", "content": "def f():\n    pass"}, {"role": "user", "content": "again"}],
])
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_chat_template_equals_transformers(tok, hf_tok, messages, add_generation_prompt):
    for tokenize in (False, True):
        ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize)
        theirs = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=tokenize)
        if tokenize and not isinstance(theirs, list):  # transformers 5 returns a BatchEncoding
            theirs = theirs["input_ids"]
        assert ours == theirs


def test_sentencepiece_style_tokenizer_equals_transformers(tmp_path):
    directory = sentencepiece_like(tmp_path / "sp")
    ours, theirs = Tokenizer.from_dir(directory), transformers.AutoTokenizer.from_pretrained(directory)
    for text in ["hello world", *REAL_TEXTS]:
        assert ours.encode(text) == theirs.encode(text)
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    assert ours.eos_token_ids == (theirs.eos_token_id,)
