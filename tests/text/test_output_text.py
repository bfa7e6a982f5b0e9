"""Per-sequence output text: real tokens of the asset tokenizer through detokenizer + stop strings."""

from __future__ import annotations

import pytest

from jpaged.text.output_text import OutputText
from tests.helpers.text_assets import BYTE_CHAR


def _run(tok, text, **kwargs):
    out = OutputText(tok, **kwargs)
    ids = tok.encode(text, add_special_tokens=False)
    streamed, stop = "", None
    for t in ids:
        stop = out.add_token(t)
        streamed += out.take_delta()
        if stop is not None:
            break
    else:
        stop = out.finish()
    return out, streamed + out.take_delta(), stop


def test_stop_string_split_over_multibyte_tokens(tok):
    text = "print('日本語')  # 終わり\nmore"
    ids = tok.encode("終わり", add_special_tokens=False)
    assert len(ids) > 3  # the stop string's bytes arrive over several tokens, mid-character
    out, streamed, stop = _run(tok, text, stop=["終わり"])
    assert stop == "終わり" and out.stopped_by == "終わり"
    assert out.text == streamed == "print('日本語')  # "


def test_no_stop_gives_the_whole_decode(tok):
    text = "emoji 🙂👍🏽 done\n\n"
    out, streamed, stop = _run(tok, text, stop=["\n\n\n"])
    assert stop is None and out.text == streamed == text and out.finished


def test_include_stop_and_special_tokens(tok):
    out = OutputText(tok, stop=["<|im_end|>"], skip_special_tokens=False, include_stop_str_in_output=True)
    for t in tok.encode("x = 1", add_special_tokens=False):
        assert out.add_token(t) is None
    assert out.add_token(tok.token_to_id("<|im_end|>")) == "<|im_end|>"
    assert out.text == "x = 1<|im_end|>" and out.take_delta() == "x = 1<|im_end|>"
    with pytest.raises(RuntimeError):
        out.add_token(5)


def test_finish_flushes_an_incomplete_character(tok):
    out = OutputText(tok, stop=["zzz"])
    for b in "€".encode()[:2]:  # two of its three bytes, as single-byte tokens
        assert out.add_token(tok.token_to_id(BYTE_CHAR[b])) is None
    assert out.text == "" and out.take_delta() == ""
    assert out.finish() is None
    assert out.text == out.take_delta() == "\ufffd"  # what tokenizer.decode gives for those bytes
