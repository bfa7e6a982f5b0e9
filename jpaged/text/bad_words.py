"""bad_words as token ids: the sequences the engine bans the completion of (vLLM's rule).

Each word is encoded as it is and with a leading space (a word at the start of a text and in its
middle usually tokenize differently); the spaced form is kept when its first token differs and it
has as many tokens, as vLLM's `SamplingParams.update_from_tokenizer` keeps it. Pure Python.
"""

from __future__ import annotations

import dataclasses

from jpaged.core.sequence import SamplingParams
from jpaged.text.tokenizer import Tokenizer


def bad_words_token_ids(tokenizer: Tokenizer, words: tuple[str, ...], field: str = "bad_words") -> list[list[int]]:
    """The token-id sequences of `words`; a word that encodes to nothing is a ValueError naming it."""
    sequences: list[list[int]] = []
    for i, word in enumerate(words):
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            raise ValueError(f"{field}[{i}]: {word!r} encodes to no token")
        sequences.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def with_bad_word_ids(params: SamplingParams, tokenizer: Tokenizer | None) -> SamplingParams:
    """`params` with bad_words_token_ids filled from its bad_words (as given without a tokenizer, or
    when it holds ids already: the engine's door then decides)."""
    if not params.bad_words or params.bad_words_token_ids or tokenizer is None:
        return params
    return dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(tokenizer, params.bad_words))
