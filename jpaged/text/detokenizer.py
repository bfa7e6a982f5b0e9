"""Incremental detokenization: the text a sequence gains with each new token, whole characters only.

A byte-level BPE token is a run of bytes that may end inside a multi-byte UTF-8 character (CJK is
3 bytes, emoji 4, and merges cut anywhere), so "decode the new token" is wrong; decoding the whole
sequence every step is right but quadratic. Two detokenizers, one contract:

- `ByteLevelDetokenizer` (tokenizers whose decoder is ByteLevel: GPT-2, LLaMA-3, Qwen, the asset
  model): each id maps to its bytes once (`byte_pieces`); per token, the pending bytes plus the new
  ones go through CPython's UTF-8 decoder, which returns the complete characters (invalid bytes as
  U+FFFD, as a full decode gives them) and how many bytes it used; the rest waits. O(1) per token.
- `PrefixDetokenizer` (any tokenizer, e.g. SentencePiece-style decoders that strip or add spaces
  by context): vLLM's prefix/read offsets; decodes the last few ids twice per token and emits the
  difference once it no longer ends in U+FFFD.

`add(token_id) -> str` returns the new complete text; `flush() -> str` returns what is left when
the sequence ends (an incomplete character becomes U+FFFD). The texts joined equal
`tokenizer.decode(output_ids)` (PrefixDetokenizer with prompt context: the text the output adds
to the prompt's). After every token the byte-level text so far is exactly the decode of the ids so
far less an incomplete trailing character; the prefix one also holds back a trailing U+FFFD that
invalid bytes produced, until a later token or the flush. (A ByteFallback decoder replaces an
invalid byte run by one U+FFFD per byte, which can rewrite text a shorter prefix decoded; there
the prefix detokenizer keeps what it already emitted, as vLLM's does.) Pure Python, no jax.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol

from jpaged.text.tokenizer import Tokenizer

# Prompt ids given as left context to PrefixDetokenizer (vLLM uses 5): enough for a decoder to
# see that the first output token continues a word.
PREFIX_CONTEXT_TOKENS = 5


class IncrementalDetokenizer(Protocol):
    """Turns one sequence's output tokens into text as they arrive."""

    def add(self, token_id: int) -> str:
        """Appends `token_id`; returns the text it completes ('' while a character is incomplete)."""

    def flush(self) -> str:
        """The text still held back, at the end of the sequence."""


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character map, inverted: the alphabet ByteLevel pieces are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


@lru_cache(maxsize=8)
def byte_pieces(tokenizer: Tokenizer, skip_special_tokens: bool) -> tuple[bytes, ...]:
    """The bytes every id decodes to, as the ByteLevel decoder produces them: [vocab_size].

    A piece written in the byte alphabet maps char by char; one with other characters (an added
    token such as "héllo wörld") is its own UTF-8, as in the Rust decoder. Skipped specials are b"".
    """
    if tokenizer.decoder_type != "ByteLevel":
        raise ValueError(f"{tokenizer.source}: decoder is not ByteLevel; use PrefixDetokenizer")
    alphabet = _gpt2_byte_decoder()
    pieces = []
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.id_to_token(token_id) or ""
        if skip_special_tokens and token_id in tokenizer.all_special_ids:
            pieces.append(b"")
        elif all(c in alphabet for c in piece):
            pieces.append(bytes(alphabet[c] for c in piece))
        else:
            pieces.append(piece.encode("utf-8"))
    return tuple(pieces)


class ByteLevelDetokenizer:
    """Exact, O(1)-per-token detokenization for byte-level BPE tokenizers."""

    __slots__ = ("_pieces", "_pending")

    def __init__(self, pieces: Sequence[bytes]) -> None:
        """`pieces` from `byte_pieces(tokenizer, skip_special_tokens)`."""
        self._pieces = pieces
        self._pending = b""  # bytes of an incomplete trailing character

    def add(self, token_id: int) -> str:
        """See `IncrementalDetokenizer.add`. Ids outside the vocabulary decode to '' (as in tokenizers)."""
        piece = self._pieces[token_id] if 0 <= token_id < len(self._pieces) else b""
        data = self._pending + piece
        text, used = codecs.utf_8_decode(data, "replace", False)  # final=False keeps a possible prefix
        rest = data[used:]
        # Python keeps b"\xed" + a byte in A0..BF (a UTF-16 surrogate, never valid) as if it could
        # still complete; a real incomplete character decodes to exactly one U+FFFD.
        if rest and rest.decode("utf-8", "replace") != "\ufffd":
            text, rest = text + rest.decode("utf-8", "replace"), b""
        self._pending = rest
        return text

    def flush(self) -> str:
        """See `IncrementalDetokenizer.flush`."""
        text, self._pending = self._pending.decode("utf-8", "replace"), b""
        return text


class PrefixDetokenizer:
    """Detokenization for any tokenizer: decode a short window twice per token (vLLM's offsets)."""

    __slots__ = ("_tokenizer", "_skip", "_ids", "_read")

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()) -> None:
        """`prompt_ids`' last few tokens are context only: their text is never emitted."""
        self._tokenizer, self._skip = tokenizer, skip_special_tokens
        self._ids = list(prompt_ids[-PREFIX_CONTEXT_TOKENS:])  # ids from the prefix offset on
        self._read = len(self._ids)  # ids before this index have had their text emitted

    def _delta(self, final: bool) -> str:
        decode = self._tokenizer.backend.decode
        prefix_text = decode(self._ids[:self._read], skip_special_tokens=self._skip)
        full_text = decode(self._ids, skip_special_tokens=self._skip)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""  # nothing new yet, or the last character is still incomplete
        # The emitted window becomes the context of the next one.
        self._ids, self._read = self._ids[self._read:], len(self._ids) - self._read
        return full_text[len(prefix_text):]

    def add(self, token_id: int) -> str:
        """See `IncrementalDetokenizer.add`."""
        self._ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """See `IncrementalDetokenizer.flush`."""
        return self._delta(final=True)


def make_detokenizer(tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                     prompt_ids: Sequence[int] = ()) -> IncrementalDetokenizer:
    """The fastest exact detokenizer for `tokenizer` (byte-level when possible) for one sequence.

    `prompt_ids` matter only to PrefixDetokenizer (context for the first output token); the
    byte-level one emits exactly `tokenizer.decode(output_ids)` and needs none.
    """
    if tokenizer.decoder_type == "ByteLevel":
        return ByteLevelDetokenizer(byte_pieces(tokenizer, skip_special_tokens))
    return PrefixDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)
