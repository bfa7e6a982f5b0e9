"""Tokenizer front end on the asset model's files: special tokens, encode/decode, chat template."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jpaged.text.chat_template import ChatTemplateError, render
from jpaged.text.tokenizer import Tokenizer
from tests.helpers.text_assets import ASSET, REAL_TEXTS


def test_special_tokens_from_the_configs(tok):
    assert tok.vocab_size == 4096
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    # tokenizer_config's eos, then generation_config's list (which adds <|im_end|>, the end of a turn).
    assert tok.eos_token_ids == (2, tok.token_to_id("<|im_end|>")) == (2, 4)
    assert tok.all_special_ids == frozenset(range(5))
    assert tok.special_tokens == {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}


def test_encode_adds_bos_once(tok):
    ids = tok.encode("import os\n")
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert tok.encode("import os\n", add_special_tokens=False) == ids[1:]
    assert tok.decode(ids) == "import os\n"
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>import os\n"


@pytest.mark.parametrize("text", REAL_TEXTS)
def test_real_text_round_trips(tok, text):
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_round_trips(tok, text):
    # Byte-level BPE: every string encodes, and decoding gives it back exactly (special tokens'
    # text, e.g. "<|im_start|>", becomes the special token, as in transformers: keep it to compare).
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_decode_rejects_bad_ids(tok):
    with pytest.raises(ValueError, match=r"token_ids\[1\]: must be a token id in \[0, 4096\), got 4096"):
        tok.decode([5, 4096])
    with pytest.raises(ValueError, match=r"token_ids\[0\]"):
        tok.decode([-1])


def _copy_with_config(tmp_path, **changes):
    directory = tmp_path / "tok"
    directory.mkdir()
    shutil.copy(ASSET / "tokenizer.json", directory)
    config = json.loads((ASSET / "tokenizer_config.json").read_text()) | changes
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_tokenizer_json_decides_bos_and_contradicting_flags_warn(tmp_path, caplog):
    plain = Tokenizer.from_dir(_copy_with_config(tmp_path, add_bos_token=False, add_eos_token=True))
    ids = plain.encode("x = 1")
    assert ids[0] == plain.bos_token_id and ids[-1] != plain.eos_token_id  # as transformers 5 does
    assert "add_bos_token=False but tokenizer.json's post-processor adds it" in caplog.text
    assert "add_eos_token=True but tokenizer.json's post-processor does not add it" in caplog.text
    assert plain.eos_token_ids == (2,)  # no generation_config.json in this directory


def test_bad_directories_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    with pytest.raises(ValueError, match="bos_token '<nope>' is not in the vocabulary"):
        Tokenizer.from_dir(_copy_with_config(tmp_path, bos_token="<nope>"))
    (tmp_path / "tok" / "generation_config.json").write_text('{"eos_token_id": "two"}')
    with pytest.raises(ValueError, match="generation_config.json: eos_token_id"):
        Tokenizer.from_dir(tmp_path / "tok")


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Sort a list."},
        {"role": "assistant", "content": "sorted(xs)"}, {"role": "user", "content": "In place?"}]


def test_chat_template_renders_chatml(tok):
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True)
    assert text == ("<|bos|><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSort a list.<|im_end|>\n"
                    "<|im_start|>assistant\nsorted(xs)<|im_end|>\n<|im_start|>user\nIn place?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not tok.apply_chat_template(CHAT).endswith("assistant\n")
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids.count(tok.bos_token_id) == 1 and ids.count(4) == 4  # one BOS, one <|im_end|> per message


def test_chat_template_content_parts_and_none_keys(tok):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}},
                                          {"type": "text", "text": "b"}], "name": None}]
    assert tok.apply_chat_template(parts) == "<|bos|><|im_start|>user\nab<|im_end|>\n"


@pytest.mark.parametrize("messages, message", [
    ([{"role": "tool", "content": "x"}], "roles must be system, user or assistant, got tool"),
    ([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}], "Only the first message"),
    ([{"content": "x"}], r"messages\[0\].role: must be a string"),
    ([{"role": "user", "content": object()}], r"messages\[0\].content: must be JSON data"),
    ("hello", "messages: must be a list"),
])
def test_chat_template_errors_are_value_errors(tok, messages, message):
    with pytest.raises(ChatTemplateError, match=message):
        tok.apply_chat_template(messages)
    assert issubclass(ChatTemplateError, ValueError)  # a server answers it with 400


def test_jinja_environment_matches_transformers():
    # trim_blocks / lstrip_blocks: block tags on their own lines leave no blank lines or indentation.
    source = ("{% for m in messages %}\n    {% if loop.index > 2 %}{% break %}{% endif %}\n"
              "{{ m['content'] | tojson }}\n{% endfor %}{{ bos_token }}{{ eos_token }}")
    messages = [{"role": "user", "content": c} for c in ("<b>&", "é", "z")]
    assert render(source, messages, special_tokens={"bos_token": "B", "eos_token": "E"}) == '"<b>&"\n"é"\nBE'
    with pytest.raises(ChatTemplateError, match="syntax error at line 1"):
        render("{% for %}", [])
    with pytest.raises(ChatTemplateError, match="boom"):
        render("{{ raise_exception('boom') }}", [])
    with pytest.raises(ChatTemplateError):  # the sandbox: no attribute escapes
        render("{{ messages.__class__.__mro__ }}", [])
    assert len(render("{{ strftime_now('%Y') }}", [])) == 4


def test_no_template_is_a_clear_error(tmp_path):
    plain = Tokenizer.from_dir(_copy_with_config(tmp_path, chat_template=None))
    with pytest.raises(ChatTemplateError, match="has no chat_template"):
        plain.apply_chat_template(CHAT)
    (tmp_path / "tok" / "chat_template.jinja").write_text("{{ messages | length }}")
    assert Tokenizer.from_dir(tmp_path / "tok").apply_chat_template(CHAT) == "4"


def test_chat_template_file_wins_over_the_config(tmp_path):
    directory = _copy_with_config(tmp_path)
    (directory / "chat_template.jinja").write_text("{{ bos_token }}{{ messages[0]['content'] }}")
    assert Tokenizer.from_dir(directory).apply_chat_template(CHAT) == "<|bos|>Be brief."
