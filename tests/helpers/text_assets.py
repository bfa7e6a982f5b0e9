"""Shared by the front-end and asset-model tests: the committed asset, real text, a SentencePiece-style
tokenizer built on the fly, and the byte-level alphabet."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from jpaged.text.detokenizer import _gpt2_byte_decoder

ASSET = Path(__file__).resolve().parents[2] / "assets" / "stdlib-lm"

BYTE_CHAR = {b: c for c, b in _gpt2_byte_decoder().items()}  # byte -> its single-byte token's piece

# Real text the detokenizer must never garble: accents, CJK, emoji with skin tone and ZWJ, Hangul.
REAL_TEXTS = [
    "def naïve_café(x):\n    return x  # déjà vu\n",
    "日本語のテキスト、中文文本。한국어 텍스트.",
    "emoji 🙂👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 done",
    "print('Ünïcödé ✓ — “quotes” … ½ ∑ ∞')\n\n# end",
]

# Not from the standard library (so not training text): ordinary Python the model should find likely.
SNIPPET = '''import os
import sys


class Config:
    """Settings read from the environment."""

    def __init__(self, name, value=None):
        self.name = name
        self.value = value

    def __repr__(self):
        return f"{self.__class__.__name__}({self.name!r}, {self.value!r})"


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    for arg in argv:
        if not os.path.exists(arg):
            raise FileNotFoundError(arg)
    return 0
'''


def sentencepiece_like(directory: Path) -> Path:
    """A LLaMA-2-style tokenizer dir: Metaspace pieces, byte fallback, a decoder that strips one space.

    Decoding it is not a concatenation of per-token strings (the first piece loses its space),
    which is what PrefixDetokenizer exists for. Trained in a blink on a few lines.
    """
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens", *REAL_TEXTS[:1]] * 20
    trainer_tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    trainer_tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    specials = ["<unk>", "<s>", "</s>"]
    trainer_tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=specials))
    vocab = trainer_tok.get_vocab()
    for b in range(256):  # byte-fallback pieces, as LLaMA-2's vocabulary has them
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    merges = [tuple(m) for m in json.loads(trainer_tok.to_str())["model"]["merges"]]  # [[left, right], ...]
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.add_special_tokens(specials)
    tok.normalizer = trainer_tok.normalizer
    tok.pre_tokenizer = trainer_tok.pre_tokenizer
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": true}')
    return directory
