"""The tiny model's synthetic task: copy a sequence of distinct tokens seen far back in the prompt.

An example is `SEP x_1 .. x_L SEP x_1 .. x_k` with distinct content tokens; the answer is
`x_{k+1} .. x_{k+m}`. Each answer token sits L + 1 positions back, so a model can only answer by
attending far into the prompt through the KV cache: a correct paged cache scores near 100%, a
corrupted one (wrong blocks, wrong order) near chance. Tokens are distinct, so "find the current
token earlier and copy its successor" (an induction head) is unambiguous.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PAD = 0  # padding in training batches; never part of an example
SEP = 1  # opens the source and opens the copy
FIRST_CONTENT = 2  # content tokens are [FIRST_CONTENT, vocab_size)


@dataclasses.dataclass(frozen=True)
class CopyTask:
    """Sizes of the copy task (defaults: the committed tiny-copy checkpoint's training setup)."""

    vocab_size: int = 512  # model vocabulary; content tokens are [2, vocab_size)
    min_source: int = 16  # shortest source sequence L
    max_source: int = 128  # longest source sequence L (distinct tokens, so < vocab_size - 2)
    answer_len: int = 16  # tokens to generate per example (m)

    def __post_init__(self) -> None:
        if not 1 <= self.min_source <= self.max_source <= self.vocab_size - FIRST_CONTENT:
            raise ValueError(f"min_source/max_source must satisfy 1 <= {self.min_source} <= {self.max_source} "
                             f"<= vocab_size - 2 = {self.vocab_size - FIRST_CONTENT}")
        if not 1 <= self.answer_len <= self.min_source:
            raise ValueError(f"answer_len must be in [1, min_source={self.min_source}], got {self.answer_len}")

    def source(self, rng: np.random.Generator, length: int) -> np.ndarray:
        """`length` distinct content tokens: i32[length]."""
        return rng.choice(np.arange(FIRST_CONTENT, self.vocab_size), size=length, replace=False).astype(np.int32)

    def examples(self, rng: np.random.Generator, n: int, min_source: int | None = None,
                 ) -> list[tuple[list[int], list[int]]]:
        """`n` (prompt, answer) pairs; the prompt already holds a random-length prefix of the copy."""
        out = []
        for _ in range(n):
            length = int(rng.integers(min_source or self.min_source, self.max_source + 1))
            src = self.source(rng, length)
            k = int(rng.integers(0, length - self.answer_len + 1))  # copy tokens already in the prompt
            prompt = [SEP, *src.tolist(), SEP, *src[:k].tolist()]
            out.append((prompt, src[k:k + self.answer_len].tolist()))
        return out

    def train_batch(self, rng: np.random.Generator, batch_size: int, max_source: int | None = None,
                    ) -> tuple[np.ndarray, np.ndarray]:
        """Full sequences (sources up to `max_source`, default the task's) and a loss mask on the copy half.

        Returns tokens i32[B, 2 * max_source + 2] (PAD-padded) and mask f32 of the same shape,
        where mask[b, t] = 1 if tokens[b, t + 1] is a copied token (the target of position t).
        """
        max_source = max_source or self.max_source
        tokens = np.full((batch_size, 2 * max_source + 2), PAD, np.int32)
        mask = np.zeros(tokens.shape, np.float32)
        for b in range(batch_size):
            length = int(rng.integers(self.min_source, max_source + 1))
            src = self.source(rng, length)
            tokens[b, :2 * length + 2] = [SEP, *src, SEP, *src]
            mask[b, length + 1:2 * length + 1] = 1.0  # predict src[0] at the second SEP, ..., src[-1]
        return tokens, mask


def score(generated: list[list[int]], answers: list[list[int]]) -> dict[str, float]:
    """Token accuracy and exact-match rate of generated answers (each compared on the answer length)."""
    if len(generated) != len(answers) or not answers:
        raise ValueError(f"generated: expected {len(answers)} (> 0) answers, got {len(generated)}")
    correct = total = exact = 0
    for gen, ans in zip(generated, answers):
        hits = sum(int(g == a) for g, a in zip(gen[:len(ans)], ans))
        correct, total, exact = correct + hits, total + len(ans), exact + int(hits == len(ans))
    return {"token_accuracy": correct / total, "exact_match": exact / len(answers)}
