"""Hand-written TokenConstraints for tests of the structured-output seam (jpaged.core.constraints)."""

import numpy as np

from jpaged.core.constraints import set_bits


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
