"""Text <-> token ids for a local Hugging Face model directory, without transformers.

`Tokenizer.from_dir(path)` reads, from that directory only (no network):
- tokenizer.json, with the `tokenizers` library (the Rust tokenizer transformers' fast tokenizers wrap);
- tokenizer_config.json: special tokens (bos/eos/unk/pad), add_bos_token / add_eos_token, and the
  chat template (or chat_template.jinja beside it);
- generation_config.json (or else config.json), for the end-of-sequence ids generation stops at.

What `encode(add_special_tokens=True)` adds (BOS, usually) is decided by tokenizer.json's
post-processor alone, as in transformers 5, which drops tokenizer_config's add_bos_token /
add_eos_token whenever a tokenizer.json exists; a flag that disagrees with the post-processor is
logged as a warning. Pure Python, no jax.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from jpaged.text.chat_template import ChatTemplateError
from jpaged.text.chat_template import render as render_chat

log = logging.getLogger(__name__)

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def check_encodable(text: str, field: str) -> None:
    """ValueError naming `field` when `text` cannot be encoded as UTF-8, which no tokenizer reads:
    a lone UTF-16 surrogate (JSON's "\\ud800" escape decodes to one) has no UTF-8 form."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{field}: is not valid Unicode text: the lone surrogate {text[exc.start]!r} at character "
                         f"{exc.start} has no UTF-8 encoding") from None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(value).__name__}")
    return value


def _token_content(value: Any, field: str) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict with "content"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"tokenizer_config.json: {field} must be a string or {{'content': str}}, got {value!r}")


def _id_list(value: Any, field: str) -> list[int]:
    """An eos_token_id field: absent, one id, or a list of ids."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{field}: must be a token id or a list of token ids, got {value!r}")
    return values


def _pick_template(value: Any, source: Path) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named templates ("default" used)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{source}: chat_template must be a string or a list with a 'default' entry")


class Tokenizer:
    """A model's tokenizer: encode / decode, special tokens, stop ids and the chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, config: Mapping[str, Any], *,
                 generation_eos_ids: Sequence[int] = (), template: str | None = None,
                 source: str = "tokenizer") -> None:
        """Wraps `backend` with tokenizer_config.json's settings (`config`); see `from_dir`."""
        self.backend = backend
        self.source = source
        # The decoder's type ("ByteLevel", "Sequence", ...): detokenizers pick their algorithm by it.
        self.decoder_type: str | None = (json.loads(backend.to_str()).get("decoder") or {}).get("type")
        self.chat_template = template
        self.special_tokens: dict[str, str] = {}  # bos_token -> "<|bos|>", ... (the chat template's variables)
        for name in _SPECIAL_NAMES:
            content = _token_content(config.get(name), name)
            if content is not None:
                if backend.token_to_id(content) is None:
                    raise ValueError(f"{source}: {name} {content!r} is not in the vocabulary")
                self.special_tokens[name] = content
        self.bos_token_id = self._special_id("bos_token")
        self.eos_token_id = self._special_id("eos_token")
        self.pad_token_id = self._special_id("pad_token")
        self.all_special_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special)
        stops = ([self.eos_token_id] if self.eos_token_id is not None else []) + list(generation_eos_ids)
        # Where generation stops by default: the tokenizer's eos plus generation_config's list (chat
        # models list their end-of-turn token there), in that order, without repeats (as vLLM).
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(stops))
        for token_id in self.eos_token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(f"{source}: eos_token_id {token_id} is outside the vocabulary [0, {self.vocab_size})")
        self._warn_on_ignored_flags(config)

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer:
        """Loads the tokenizer of a local Hugging Face model directory (tokenizer.json required)."""
        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{directory}: no tokenizer.json (only the fast-tokenizer format is read)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception on malformed files
            raise ValueError(f"{path}: cannot be read by the tokenizers library ({exc})") from None
        config_path = directory / "tokenizer_config.json"
        config = _read_json(config_path)
        # A chat_template.jinja file takes priority over the config's entry, as in transformers 5.
        jinja_file = directory / "chat_template.jinja"
        template = (jinja_file.read_text(encoding="utf-8") if jinja_file.is_file()
                    else _pick_template(config.get("chat_template"), config_path))
        # generation_config.json's eos ids (transformers' generate stops at them), else config.json's.
        gen_path, model_path = directory / "generation_config.json", directory / "config.json"
        gen_config = _read_json(gen_path)
        eos_path = gen_path if "eos_token_id" in gen_config else model_path
        eos = _id_list(_read_json(eos_path).get("eos_token_id"), f"{eos_path}: eos_token_id")
        return cls(backend, config, generation_eos_ids=eos, template=template, source=str(directory))

    def _special_id(self, name: str) -> int | None:
        content = self.special_tokens.get(name)
        return None if content is None else self.backend.token_to_id(content)

    def _warn_on_ignored_flags(self, config: Mapping[str, Any]) -> None:
        """Logs add_bos_token / add_eos_token values that tokenizer.json's post-processor contradicts."""
        probe = self.backend.encode("a", add_special_tokens=True).ids
        for flag, token_id, added in (("add_bos_token", self.bos_token_id, probe[:1] == [self.bos_token_id]),
                                      ("add_eos_token", self.eos_token_id, probe[-1:] == [self.eos_token_id])):
            if flag in config and token_id is not None and bool(config[flag]) != added:
                log.warning("%s: tokenizer_config.json has %s=%s but tokenizer.json's post-processor %s it; "
                            "the post-processor decides (as in transformers 5)", self.source, flag,
                            config[flag], "adds" if added else "does not add")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (ids are in [0, vocab_size))."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True, field: str = "text") -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the post-processor adds (BOS, usually).
        Raises TypeError / ValueError naming `field` for a non-str or text with no UTF-8 form."""
        if not isinstance(text, str):
            raise TypeError(f"{field}: must be a str, got {type(text).__name__}")
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the Rust side's "TextInputSequence must be str": a lone surrogate
            check_encodable(text, field)
            raise

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True,
                     field: str = "texts") -> list[list[int]]:
        """`encode` of many texts at once (the Rust side runs them in parallel, without the GIL);
        errors name `field[i]`."""
        try:
            return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]
        except TypeError:
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise TypeError(f"{field}[{i}]: must be a str, got {type(text).__name__}") from None
                check_encodable(text, f"{field}[{i}]")
            raise

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text of `token_ids`; invalid or incomplete UTF-8 becomes U+FFFD."""
        ids = list(token_ids)
        self.check_ids(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def check_ids(self, token_ids: Sequence[int], field: str = "token_ids") -> None:
        """ValueError naming `field` unless every id is an int in [0, vocab_size)."""
        n = self.vocab_size
        for i, t in enumerate(token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < n:
                raise ValueError(f"{field}[{i}]: must be a token id in [0, {n}), got {t!r}")

    def token_to_id(self, token: str) -> int | None:
        """The id of vocabulary entry `token` (an added token's content, or a BPE piece), or None."""
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of `token_id` (byte-level pieces are in the GPT-2 byte alphabet)."""
        return self.backend.id_to_token(token_id)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                            tokenize: bool = False, chat_template: str | None = None,
                            **variables: Any) -> str | list[int]:
        """Renders `messages` with the chat template, like transformers' `apply_chat_template`.

        Returns the prompt text, or with `tokenize=True` its ids, encoded without adding special
        tokens (the template writes them). `chat_template` overrides the model's template;
        `variables` (tools, documents, ...) are passed to it. Raises ChatTemplateError.
        """
        source = chat_template if chat_template is not None else self.chat_template
        if source is None:
            raise ChatTemplateError(f"{self.source}: the model has no chat_template "
                                    "(tokenizer_config.json or chat_template.jinja)")
        text = render_chat(source, messages, add_generation_prompt=add_generation_prompt,
                           special_tokens=self.special_tokens, **variables)
        return self.encode(text, add_special_tokens=False, field="messages") if tokenize else text
