"""The seam for structured outputs: a TokenConstraint says which tokens a sequence may sample next.

A request attaches one in its starting state (`SamplingParams.constraint`); every sequence of
the request gets its own copy (`fork`), forks of a sequence copy its state. Each step the sample
rows' constraints write their allowed tokens into bitmask rows (`SampleRows.batch` gathers them),
the sampler masks every other token on device, and after the step the postprocessor advances each
constraint past its sampled token (`accept`); a constraint that `is_terminated` ends its sequence
with finish reason "stop". A grammar library plugs in by wrapping its matcher in this protocol:
llguidance's `LLMatcher` (`fill_next_token_bitmask`, `consume_token`, `is_stopped`, `deep_copy`)
and xgrammar's `GrammarMatcher` use this very bitmask layout. Pure Python + numpy: no jax import.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a bitmask over `vocab_size` tokens: token t is bit t % 32 of word t // 32."""
    return -(-vocab_size // 32)


def set_bits(bitmask: np.ndarray, token_ids: np.ndarray) -> None:
    """Marks `token_ids` (i32[K]) allowed in `bitmask` (i32[words]), in place."""
    words = np.zeros(len(bitmask), np.uint32)
    np.bitwise_or.at(words, token_ids // 32, np.left_shift(np.uint32(1), (token_ids % 32).astype(np.uint32)))
    bitmask |= words.view(np.int32)


@runtime_checkable
class TokenConstraint(Protocol):
    """Which tokens one sequence may sample next: a matcher advanced token by token (host side)."""

    vocab_size: int  # tokens its bitmask covers; ids from vocab_size up are never allowed

    def allowed(self, bitmask: np.ndarray) -> None:
        """Writes the tokens allowed next into `bitmask` i32[bitmask_words(vocab_size)], zeroed by
        the caller: token t allowed <=> bit t % 32 of word t // 32 is set."""

    def accept(self, token: int) -> bool:
        """Advances past the sampled `token`; False if it was not allowed (its request then fails)."""

    def is_terminated(self) -> bool:
        """True once the output is complete: the sequence ends (finish reason "stop")."""

    def fork(self) -> TokenConstraint:
        """An independent copy in the same state: a new sample of the request continues from it."""
