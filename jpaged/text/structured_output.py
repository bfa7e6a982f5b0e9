"""Structured outputs: StructuredOutputsParams compiled by llguidance into TokenConstraints.

llguidance (Microsoft's Rust grammar engine, the one vLLM's `guidance` backend uses) fills the
seam's bitmask layout (jpaged.core.constraints) straight from its matcher, needs neither torch nor
transformers, and reads the model's tokenizer.json text as it is: the adapter below hands it the
`tokenizers` backend's JSON, so nothing but the model directory is read (docs/notes/serving.md says
why not xgrammar). The sampler masks on device what the bitmask leaves out; the postprocessor
advances each sequence's matcher past its sampled token on the host.

Compiling a grammar (schema -> lexer and parser tables over the vocabulary) costs milliseconds; a
copy of a compiled matcher costs a microsecond. So each tokenizer has one GrammarCompiler that
keeps the last `cache_size` compiled grammars, keyed by their llguidance text (the schema, regex,
choice or grammar text with its options), and every request starts from a copy. Pure Python over
llguidance's native code: no jax.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
import weakref
from collections import OrderedDict
from typing import Any

import llguidance
import numpy as np

from jpaged.core.constraints import StructuredOutputsParams, bitmask_words
from jpaged.core.sequence import SamplingParams
from jpaged.text.tokenizer import Tokenizer

CACHE_SIZE = 256  # compiled grammars kept per tokenizer (a JSON schema's matcher holds ~100 kB)


class GrammarConstraint:
    """One sequence's llguidance matcher behind the TokenConstraint protocol."""

    __slots__ = ("matcher", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        """Wraps `matcher` (owned: nobody else advances it) over a vocabulary of `vocab_size` tokens."""
        self.matcher = matcher
        self.vocab_size = vocab_size

    def allowed(self, bitmask: np.ndarray) -> None:
        """Writes the tokens the grammar allows next into `bitmask` i32[bitmask_words(vocab_size)]."""
        # llguidance writes through a raw pointer: the array must be exactly what it expects.
        if (bitmask.dtype != np.int32 or bitmask.ndim != 1 or not bitmask.flags.c_contiguous
                or len(bitmask) != bitmask_words(self.vocab_size) or not bitmask.flags.writeable):
            raise ValueError(f"bitmask: must be a writeable contiguous int32 array of {bitmask_words(self.vocab_size)} "
                             f"words, got {bitmask.dtype} of shape {bitmask.shape}")
        self.matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)
        if self.matcher.is_error():  # a parser limit hit mid-output: this request fails, the batch goes on
            raise RuntimeError(f"grammar matcher failed: {_one_line(self.matcher.get_error())}")

    def accept(self, token: int) -> bool:
        """Advances past `token`; False (and the matcher in its error state) if the grammar forbids it."""
        return self.matcher.consume_token(token)

    def is_terminated(self) -> bool:
        """True once the output is complete: EOS taken, or nothing can extend it."""
        return self.matcher.is_stopped()

    def fork(self) -> GrammarConstraint:
        """An independent copy in the same state."""
        return GrammarConstraint(self.matcher.deep_copy(), self.vocab_size)


def _one_line(message: str, limit: int = 300) -> str:
    """llguidance's multi-line error text as one line of at most `limit` characters."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _forbid_additional_properties(schema: Any) -> None:
    """vLLM's disable_additional_properties: every object schema with properties and no
    "additionalProperties" gets `false`, in place."""
    if isinstance(schema, dict):
        for value in schema.values():
            _forbid_additional_properties(value)
        if "additionalProperties" not in schema and ("properties" in schema or "patternProperties" in schema):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        for item in schema:
            _forbid_additional_properties(item)


def grammar_text(params: StructuredOutputsParams, field: str) -> str:
    """The llguidance grammar of `params`, as vLLM's guidance backend builds it (`field` names the
    spec in errors: a schema that is not a JSON object, a GBNF grammar that does not convert)."""
    whitespace = {"whitespace_flexible": not params.disable_any_whitespace}
    kind = params.kind
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=whitespace)
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{field}: not valid JSON ({exc})") from None
        elif params.disable_additional_properties:
            schema = copy.deepcopy(schema)  # the caller's dict stays as given
        if not isinstance(schema, dict):
            raise ValueError(f"{field}: a JSON schema must be a JSON object, got {type(schema).__name__}")
        if params.disable_additional_properties:
            _forbid_additional_properties(schema)
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=whitespace)
        except (ValueError, TypeError) as exc:  # not serializable as JSON
            raise ValueError(f"{field}: {_one_line(str(exc))}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    try:
        return llguidance.grammar_from(kind, list(params.choice) if kind == "choice" else params.grammar)
    except ValueError as exc:  # a GBNF grammar the converter cannot read
        raise ValueError(f"{field}: {_one_line(str(exc))}") from None


class GrammarCompiler:
    """Compiles StructuredOutputsParams for one tokenizer and keeps the compiled grammars (thread-safe:
    the server compiles in its handlers while the engine thread advances matchers)."""

    def __init__(self, tokenizer: Tokenizer, cache_size: int = CACHE_SIZE):
        """Builds llguidance's view of `tokenizer` (its tokenizer.json text; ~0.1 s for 4k tokens)."""
        if not tokenizer.eos_token_ids:
            raise ValueError(f"{tokenizer.source}: structured outputs need an EOS token (a grammar ends with it)")
        try:
            self.ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                                       eos_token=list(tokenizer.eos_token_ids))
        except Exception as exc:  # the Rust side raises bare Exceptions on formats it cannot read
            raise ValueError(f"{tokenizer.source}: llguidance cannot read this tokenizer ({exc})") from exc
        self.vocab_size = tokenizer.vocab_size
        self.cache_size = cache_size
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # grammar text -> fresh matcher
        self._lock = threading.Lock()
        self.hits = 0  # compiles answered from the cache
        self.misses = 0  # grammars compiled

    def constraint(self, params: StructuredOutputsParams, field: str | None = None) -> GrammarConstraint:
        """A fresh constraint for `params`. A malformed or unsatisfiable schema, regex or grammar is a
        ValueError naming `field` (default "structured_outputs.<kind>") with llguidance's reason."""
        field = field or f"structured_outputs.{params.kind}"
        grammar = grammar_text(params, field)
        with self._lock:
            template = self._compiled.get(grammar)
            if template is not None:
                self._compiled.move_to_end(grammar)
                self.hits += 1
        if template is None:
            template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)  # drops the GIL to compile
            if template.is_error():
                raise ValueError(f"{field}: {_one_line(template.get_error())}")
            with self._lock:
                self.misses += 1
                self._compiled[grammar] = template
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
        return GrammarConstraint(template.deep_copy(), self.ll_tokenizer.vocab_size)


_compilers: weakref.WeakKeyDictionary[Tokenizer, GrammarCompiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Tokenizer) -> GrammarCompiler:
    """The GrammarCompiler of `tokenizer` (built on first use, kept while the tokenizer lives)."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
    if compiler is None:
        compiler = GrammarCompiler(tokenizer)
        with _compilers_lock:
            compiler = _compilers.setdefault(tokenizer, compiler)
    return compiler


def with_constraint(params: SamplingParams, tokenizer: Tokenizer | None, field: str | None = None) -> SamplingParams:
    """`params` with its structured_outputs compiled into `constraint` (unchanged without them);
    errors name `field` (default "structured_outputs.<kind>")."""
    spec = params.structured_outputs
    if spec is None:
        return params
    if tokenizer is None:
        raise ValueError("structured_outputs: need the model's tokenizer (this model has none)")
    return dataclasses.replace(params, structured_outputs=None,
                               constraint=compiler_for(tokenizer).constraint(spec, field))
