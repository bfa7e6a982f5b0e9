"""jpaged.text.bad_words: bad words become the token-id sequences vLLM bans (with and without a space)."""

import pytest

from jpaged.core.sequence import SamplingParams
from jpaged.text.bad_words import bad_words_token_ids, with_bad_word_ids
from jpaged.text.output_processor import engine_params


def test_each_word_as_it_is_and_after_a_space(tok):
    got = bad_words_token_ids(tok, ("return", "  import"))
    plain, spaced = tok.encode("return", add_special_tokens=False), tok.encode(" return", add_special_tokens=False)
    assert got[0] == plain
    if spaced[0] != plain[0] and len(spaced) == len(plain):
        assert got[1] == spaced
    assert tok.encode("import", add_special_tokens=False) in got  # leading spaces stripped first


def test_a_word_without_tokens_is_refused_by_name(tok):
    with pytest.raises(ValueError, match=r"bad_words\[0\]"):
        bad_words_token_ids(tok, ("   ",))  # nothing left once its leading spaces go


def test_the_engine_gets_ids_and_a_model_without_tokenizer_gets_the_words_as_they_are(tok):
    params = SamplingParams(bad_words=["return"])
    assert engine_params(params, tok).bad_words_token_ids[0] == tuple(tok.encode("return", add_special_tokens=False))
    assert with_bad_word_ids(params, None) is params  # the engine's door refuses it, naming bad_words
    given = SamplingParams(bad_words=["return"], bad_words_token_ids=[[7]])
    assert with_bad_word_ids(given, tok) is given
