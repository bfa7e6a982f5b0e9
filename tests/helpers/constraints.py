"""Hand-written TokenConstraints for tests of the structured-output seam (jpaged.core.constraints), and
a byte-level tokenizer over the tiny models' vocabulary so that real grammars run on them."""

import numpy as np
import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from jpaged.core.constraints import set_bits
from jpaged.text.detokenizer import _gpt2_byte_decoder
from jpaged.text.tokenizer import Tokenizer


def byte_tokenizer(eos: int = 3) -> Tokenizer:
    """256 tokens: token b is byte b, except `eos` (the tiny models' EOS id), the special <|eos|>."""
    byte_char = {b: c for c, b in _gpt2_byte_decoder().items()}
    vocab = {byte_char[b]: b for b in range(256) if b != eos} | {"<|eos|>": eos}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|eos|>"])
    return Tokenizer(backend, {"eos_token": "<|eos|>"}, source="byte_tokenizer")


class DigitsThenEos:
    """`min_digits` to `max_digits` tokens from `digits`, then `eos`: a grammar small enough to check by eye."""

    def __init__(self, digits, eos: int, vocab_size: int, min_digits: int = 1, max_digits: int = 3):
        self.digits, self.eos, self.vocab_size = np.asarray(digits, np.int32), eos, vocab_size
        self.min_digits, self.max_digits = min_digits, max_digits
        self.count, self.done = 0, False
        self.accepted: list[int] = []  # every token accepted, for the tests to inspect

    def allowed(self, bitmask):
        if self.count < self.max_digits:
            set_bits(bitmask, self.digits)
        if self.count >= self.min_digits:
            set_bits(bitmask, np.array([self.eos], np.int32))

    def accept(self, token):
        if token == self.eos and self.count >= self.min_digits and not self.done:
            self.done = True
        elif token in self.digits.tolist() and self.count < self.max_digits and not self.done:
            self.count += 1
        else:
            return False
        self.accepted.append(token)
        return True

    def is_terminated(self):
        return self.done

    def fork(self):
        child = DigitsThenEos(self.digits, self.eos, self.vocab_size, self.min_digits, self.max_digits)
        child.count, child.done, child.accepted = self.count, self.done, list(self.accepted)
        return child


class BrokenConstraint(DigitsThenEos):
    """Raises when asked for its bitmask: its request must fail alone."""

    def allowed(self, bitmask):
        raise RuntimeError("grammar exploded")

    def fork(self):
        return BrokenConstraint(self.digits, self.eos, self.vocab_size)
