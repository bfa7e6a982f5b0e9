"""The seam for structured outputs: a TokenConstraint says which tokens a sequence may sample next.

A request attaches one in its starting state (`SamplingParams.constraint`); every sequence of
the request gets its own copy (`fork`), forks of a sequence copy its state. Each step the sample
rows' constraints write their allowed tokens into bitmask rows (`SampleRows.batch` gathers them),
the sampler masks every other token on device, and after the step the postprocessor advances each
constraint past its sampled token (`accept`); a constraint that `is_terminated` ends its sequence
with finish reason "stop". A grammar library plugs in by wrapping its matcher in this protocol:
llguidance's `LLMatcher` (`fill_next_token_bitmask`, `consume_token`, `is_stopped`, `deep_copy`)
and xgrammar's `GrammarMatcher` use this very bitmask layout.

What a user asks for is a StructuredOutputsParams (vLLM's: a JSON schema, a regex, a choice, a
grammar, or any JSON object), pure data checked here; the text front end
(jpaged.text.structured_output) compiles it with the model's tokenizer into a TokenConstraint.
Pure Python + numpy: no jax import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from jpaged.config.checks import check_bool, check_str, show


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


# The kinds of StructuredOutputsParams, one of which a request sets.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclasses.dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match (vLLM's StructuredOutputsParams): exactly one of `json` (a JSON
    schema: a dict, or its JSON text), `regex`, `choice` (one of these strings), `grammar` (Lark, or
    GBNF as llama.cpp writes it) or `json_object` (any JSON object). Checked at construction: a wrong
    type is a TypeError, a missing or second kind a ValueError, each naming the field; the schema,
    regex and grammar themselves are checked when the text front end compiles them."""

    json: str | Mapping[str, Any] | None = dataclasses.field(default=None, hash=False)
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # json / json_object: no whitespace between tokens
    disable_additional_properties: bool = False  # json: objects without "additionalProperties" get false

    def __post_init__(self) -> None:
        field = "structured_outputs"
        if self.json is not None and not isinstance(self.json, (str, Mapping)):
            raise TypeError(f"{field}.json: must be a JSON schema (a dict or its JSON text), "
                            f"got {type(self.json).__name__} {show(self.json)}")
        check_str(f"{field}.regex", self.regex, optional=True)
        check_str(f"{field}.grammar", self.grammar, optional=True)
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, (list, tuple)):
                raise TypeError(f"{field}.choice: must be a list of strs, got {type(self.choice).__name__} "
                                f"{show(self.choice)}")
            for i, option in enumerate(self.choice):
                check_str(f"{field}.choice[{i}]", option)
            if not self.choice:
                raise ValueError(f"{field}.choice: must hold at least one str, got []")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is not None:
            check_bool(f"{field}.json_object", self.json_object)
        check_bool(f"{field}.disable_any_whitespace", self.disable_any_whitespace)
        check_bool(f"{field}.disable_additional_properties", self.disable_additional_properties)
        for name in ("regex", "grammar"):
            if getattr(self, name) == "":
                raise ValueError(f"{field}.{name}: must not be empty")
        given = self.kinds()
        if len(given) != 1:
            raise ValueError(f"{field}: give exactly one of {', '.join(STRUCTURED_KINDS)}, "
                             f"got {' and '.join(given) if given else 'none'}")

    def kinds(self) -> list[str]:
        """The kinds this sets (json_object counts when True)."""
        return [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        """The one kind this sets: "json", "regex", "choice", "grammar" or "json_object"."""
        return self.kinds()[0]
