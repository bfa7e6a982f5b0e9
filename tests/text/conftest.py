"""Fixtures: the committed asset model's tokenizer (assets/stdlib-lm), and a SentencePiece-style one."""

from __future__ import annotations

import pytest

from jpaged.text.tokenizer import Tokenizer
from tests.helpers.text_assets import ASSET, sentencepiece_like


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    """The asset model's byte-level BPE tokenizer."""
    return Tokenizer.from_dir(ASSET)


@pytest.fixture(scope="session")
def sp_tok(tmp_path_factory) -> Tokenizer:
    """A SentencePiece-style (non-byte-level) tokenizer."""
    return Tokenizer.from_dir(sentencepiece_like(tmp_path_factory.mktemp("sp")))
