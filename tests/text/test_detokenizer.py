"""Incremental detokenization against full decodes of every prefix, on random ids and on real text."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.text.detokenizer import ByteLevelDetokenizer, PrefixDetokenizer, byte_pieces, make_detokenizer
from tests.helpers.text_assets import BYTE_CHAR, REAL_TEXTS


def _stream(detok, ids):
    """Emitted text after each token, and the flushed remainder."""
    emitted, texts = "", []
    for t in ids:
        chunk = detok.add(t)
        emitted += chunk
        texts.append(emitted)
    return texts, detok.flush()


def _check_byte_level(tok, ids, skip):
    texts, rest = _stream(ByteLevelDetokenizer(byte_pieces(tok, skip)), ids)
    for i, text in enumerate(texts):
        full = tok.decode(ids[:i + 1], skip_special_tokens=skip)
        # Exactly the prefix's decode, less one U+FFFD standing for an incomplete last character.
        assert text == full or (full == text + "\ufffd"), (ids[:i + 1], text, full)
    assert (texts[-1] if texts else "") + rest == tok.decode(ids, skip_special_tokens=skip)


def _check_prefix(tok, ids, skip):
    texts, rest = _stream(PrefixDetokenizer(tok, skip_special_tokens=skip), ids)
    for i, text in enumerate(texts):
        full = tok.decode(ids[:i + 1], skip_special_tokens=skip)
        assert full.startswith(text)
        if not full.endswith("\ufffd"):
            assert text == full, (ids[:i + 1], text, full)
    assert (texts[-1] if texts else "") + rest == tok.decode(ids, skip_special_tokens=skip)


# Ids of merged multi-byte pieces are what break naive detokenizers; any id in the vocabulary.
ids_strategy = st.lists(st.integers(0, 4095), max_size=40)


@settings(max_examples=300, deadline=None)
@given(ids=ids_strategy, skip=st.booleans())
def test_byte_level_equals_decode_of_every_prefix(tok, ids, skip):
    _check_byte_level(tok, ids, skip)


@settings(max_examples=150, deadline=None)
@given(ids=ids_strategy, skip=st.booleans())
def test_prefix_detokenizer_equals_decode_of_every_prefix(tok, ids, skip):
    _check_prefix(tok, ids, skip)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, 116), max_size=30), skip=st.booleans())
def test_prefix_detokenizer_on_a_sentencepiece_tokenizer(sp_tok, ids, skip):
    # Pieces only (ids 117.. are the byte-fallback tokens <0x00>..<0xFF>): the ByteFallback decoder
    # turns an invalid byte run into one U+FFFD per byte, so decode("<0x00>") = "\x00" but
    # decode("<0x00><0x80>") = "\ufffd\ufffd" and no streamed text can equal every prefix's decode.
    # Byte-fallback tokens of valid text are covered by the real-text tests below.
    assert sp_tok.id_to_token(117) == "<0x00>" and sp_tok.id_to_token(116) != "<0xFF>"
    _check_prefix(sp_tok, ids, skip)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=24))
def test_byte_pieces_reproduce_the_rust_decoder(tok, data):
    # Any byte string, tokenized as single bytes: the lossy UTF-8 decode of Python and Rust agree.
    ids = [tok.token_to_id(BYTE_CHAR[b]) for b in data]
    assert b"".join(byte_pieces(tok, True)[i] for i in ids).decode("utf-8", "replace") == tok.decode(ids)




@pytest.mark.parametrize("text", REAL_TEXTS)
def test_real_text_streams_whole_characters(tok, sp_tok, text):
    for tokenizer in (tok, sp_tok):
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = make_detokenizer(tokenizer)
        chunks = [detok.add(t) for t in ids] + [detok.flush()]
        assert "".join(chunks) == text
        assert not any("\ufffd" in c for c in chunks)  # never a half character
        if any(ord(c) > 0x2FFF for c in text):  # CJK / emoji: their bytes span several tokens
            assert "" in chunks[:-1]  # ... so some tokens completed no character and emitted nothing


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=60))
def test_any_text_streams_back_exactly(tok, sp_tok, text):
    for tokenizer in (tok, sp_tok):
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = make_detokenizer(tokenizer, skip_special_tokens=False)  # text may spell "<|im_end|>"
        chunks = [detok.add(t) for t in ids]
        assert "".join(chunks) + detok.flush() == tokenizer.decode(ids, skip_special_tokens=False)
        if tokenizer is tok:  # byte-level: every character is out by the last token, none garbled
            assert "".join(chunks) == text


def test_prefix_detokenizer_keeps_the_space_a_prompt_context_gives(sp_tok):
    prompt = sp_tok.encode("hello", add_special_tokens=False)
    output = sp_tok.encode("hello world", add_special_tokens=False)[len(prompt):]
    detok = make_detokenizer(sp_tok, prompt_ids=prompt)
    text = "".join(detok.add(t) for t in output) + detok.flush()
    assert text == " world"  # what the output adds to the prompt's text
    assert sp_tok.decode(output) == "world"  # the decode alone strips the leading space


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("x = 1", add_special_tokens=False) + [tok.token_to_id("<|im_end|>")]
    for skip, want in ((True, "x = 1"), (False, "x = 1<|im_end|>")):
        detok = make_detokenizer(tok, skip_special_tokens=skip)
        assert "".join(detok.add(t) for t in ids) + detok.flush() == want


def test_incomplete_character_at_the_end_flushes_as_replacement(tok):
    euro = "€".encode()  # 3 bytes
    ids = [tok.token_to_id(BYTE_CHAR[b]) for b in euro[:2]]
    detok = make_detokenizer(tok)
    assert [detok.add(t) for t in ids] == ["", ""]
    assert detok.flush() == "\ufffd" == tok.decode(ids)
    assert detok.add(tok.token_to_id(BYTE_CHAR[euro[2]])) == "\ufffd"  # a lone continuation byte


def test_ids_past_the_vocabulary_decode_to_nothing(tok):
    detok = make_detokenizer(tok)
    assert detok.add(10_000) == "" and tok.backend.decode([10_000]) == ""


def test_byte_level_surrogate_bytes_are_replaced_at_once(tok):
    # b"\xed\xa1" starts a UTF-16 surrogate: never valid, so it must not wait for more bytes.
    pieces = byte_pieces(tok, False)
    ids = [pieces.index(b"\xed"), pieces.index(b"\xa1")]
    _check_byte_level(tok, ids, False)
