"""llguidance behind the constraint seam, on the asset model's tokenizer (no model, no jax): each kind
accepts its language and refuses the rest, the bitmask says exactly what `accept` takes, malformed
specs are errors naming their field, compiled grammars are cached, forks are independent."""

import json

import numpy as np
import pytest

from jpaged.core.constraints import StructuredOutputsParams as SOP
from jpaged.core.constraints import TokenConstraint, bitmask_words
from jpaged.core.sequence import SamplingParams
from jpaged.text.structured_output import GrammarCompiler, compiler_for, with_constraint
from tests.helpers.constraints import byte_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
LARK = 'start: "def " NAME "(" ")" ":"\nNAME: /[a-z_]+/'
GBNF = 'root ::= "x = " [0-9]+'

# kind -> (spec, texts in its language, texts outside it)
LANGUAGES = {
    "json": (SOP(json=SCHEMA), ['{"name": "a", "age": 3}', '{ "name" : "x y" , "age":-12}'],
             ['{"name": "a"}', '{"name": 1, "age": 2}', '[1]']),
    "json-text": (SOP(json=json.dumps(SCHEMA)), ['{"name": "a", "age": 3}'], ['{"age": 3.5, "name": ""}']),
    "json_object": (SOP(json_object=True), ['{}', '{"a": [1, {"b": null}]}'], ['[]', '1', '"x"']),
    "regex": (SOP(regex=r"[a-z]+_[0-9]{2}"), ["abc_12", "x_00"], ["abc_1", "ABC_12", "abc_123"]),
    "choice": (SOP(choice=["yes", "no", 'a "quoted" é']), ["yes", "no", 'a "quoted" é'], ["maybe", "ye"]),
    "lark": (SOP(grammar=LARK), ["def main():", "def a_b():"], ["def main()", "def Main():"]),
    "gbnf": (SOP(grammar=GBNF), ["x = 1", "x = 2024"], ["x = ", "x = a"]),
}


def feed(constraint, ids) -> bool:
    """True when the constraint takes every id in turn."""
    return all(constraint.accept(t) for t in ids)


@pytest.mark.parametrize("kind", LANGUAGES)
def test_each_kind_accepts_its_language_and_ends_there(tok, kind):
    spec, good, bad = LANGUAGES[kind]
    compiler = compiler_for(tok)
    for text in good:
        constraint = compiler.constraint(spec)
        assert isinstance(constraint, TokenConstraint)
        assert feed(constraint, tok.encode(text, add_special_tokens=False)), text
        # Complete: either nothing can follow (terminated now) or EOS ends it.
        assert constraint.is_terminated() or (constraint.accept(tok.eos_token_id) and constraint.is_terminated())
    for text in bad:
        constraint = compiler.constraint(spec)
        ids = tok.encode(text, add_special_tokens=False)
        refused = not feed(constraint, ids) or not constraint.accept(tok.eos_token_id)
        assert refused, text


def allowed_ids(constraint, vocab_size) -> set[int]:
    mask = np.zeros(bitmask_words(vocab_size), np.int32)
    constraint.allowed(mask)
    bits = np.unpackbits(mask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


@pytest.mark.parametrize("prefix", ['', '{"name', '{"name": "a", "age": 1'])
def test_the_bitmask_allows_exactly_what_accept_takes(tok, prefix):
    constraint = compiler_for(tok).constraint(SOP(json=SCHEMA))
    assert feed(constraint, tok.encode(prefix, add_special_tokens=False))
    allowed = allowed_ids(constraint, tok.vocab_size)
    assert allowed and all(constraint.fork().accept(t) for t in allowed)
    # Every refusal formats the matcher's state (~4 ms): a seeded sample of the other tokens.
    others = sorted(set(range(tok.vocab_size)) - allowed)
    sample = np.random.default_rng(0).choice(others, 150, replace=False).tolist()
    assert not any(constraint.fork().accept(t) for t in sample)


def test_forks_are_independent_and_the_cache_is_per_tokenizer(tok):
    compiler = compiler_for(tok)
    assert compiler_for(tok) is compiler
    other = compiler_for(byte_tokenizer())
    assert other is not compiler and other.vocab_size == 256
    spec = SOP(regex="[0-9]{3}")
    hits, misses = compiler.hits, compiler.misses
    first = compiler.constraint(spec)
    second = compiler.constraint(SOP(regex="[0-9]{3}"))
    assert (compiler.hits, compiler.misses) in ((hits + 1, misses + 1), (hits + 2, misses))
    assert feed(first, tok.encode("12", add_special_tokens=False))
    child = first.fork()
    assert feed(child, tok.encode("3", add_special_tokens=False)) and child.is_terminated()
    assert not first.is_terminated() and not second.is_terminated()
    assert allowed_ids(second, tok.vocab_size) == allowed_ids(compiler.constraint(spec), tok.vocab_size)


def test_the_cache_keeps_the_latest_grammars(tok):
    compiler = GrammarCompiler(tok, cache_size=2)
    for regex in ("a+", "b+", "a+", "c+", "b+"):  # "b+" was evicted by "c+" ("a+" used more recently)
        compiler.constraint(SOP(regex=regex))
    assert (compiler.hits, compiler.misses) == (1, 4)


def test_whitespace_and_additional_properties_options(tok):
    compiler = compiler_for(tok)
    spaced = tok.encode('{ "name": "a", "age": 1}', add_special_tokens=False)
    assert feed(compiler.constraint(SOP(json=SCHEMA)), spaced)
    assert not feed(compiler.constraint(SOP(json=SCHEMA, disable_any_whitespace=True)), spaced)
    extra = tok.encode('{"name": "a", "age": 1, "x": 2}', add_special_tokens=False)
    assert feed(compiler.constraint(SOP(json=SCHEMA)), extra)
    strict = SOP(json=SCHEMA, disable_additional_properties=True)
    assert not feed(compiler.constraint(strict), extra)
    assert "additionalProperties" not in SCHEMA  # the caller's schema is left as it was


@pytest.mark.parametrize("spec, field, reason", [
    (SOP(json='{"type": "object"'), "structured_outputs.json", "not valid JSON"),
    (SOP(json='[1, 2]'), "structured_outputs.json", "must be a JSON object"),
    (SOP(json={"type": "strin"}), "structured_outputs.json", "strin"),
    (SOP(json={"type": "integer", "minimum": 5, "maximum": 1}), "structured_outputs.json", "Unsatisfiable"),
    (SOP(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "structured_outputs.json", "/nope"),
    (SOP(regex="a(b"), "structured_outputs.regex", "unclosed group"),
    (SOP(grammar="start: foo"), "structured_outputs.grammar", "unknown name"),
    (SOP(grammar='root ::= "a" undefined'), "structured_outputs.grammar", "Rule 'undefined' not found"),
], ids=["json-text", "json-array", "json-type", "json-unsatisfiable", "json-ref", "regex", "lark", "gbnf"])
def test_malformed_specs_are_errors_naming_their_field(tok, spec, field, reason):
    with pytest.raises(ValueError, match=rf"^{field}: .*{reason}"):
        compiler_for(tok).constraint(spec)
    with pytest.raises(ValueError, match="^response_format.json_schema.schema: "):
        compiler_for(tok).constraint(spec, field="response_format.json_schema.schema")


def test_with_constraint_compiles_once_and_needs_a_tokenizer(tok):
    plain = SamplingParams(max_tokens=4)
    assert with_constraint(plain, tok) is plain
    params = SamplingParams(max_tokens=4, structured_outputs=SOP(choice=["a", "b"]))
    compiled = with_constraint(params, tok)
    assert compiled.structured_outputs is None and compiled.constraint is not None
    assert compiled.constraint.vocab_size == tok.vocab_size and compiled.max_tokens == 4
    with pytest.raises(ValueError, match="^structured_outputs: need the model's tokenizer"):
        with_constraint(params, None)


def test_a_matcher_in_its_error_state_fails_loudly(tok):
    constraint = compiler_for(tok).constraint(SOP(regex="[0-9]+"))
    assert not constraint.accept(tok.encode("x", add_special_tokens=False)[0])
    with pytest.raises(RuntimeError, match="grammar matcher failed"):
        constraint.allowed(np.zeros(bitmask_words(tok.vocab_size), np.int32))
    with pytest.raises(ValueError, match="bitmask: must be"):
        compiler_for(tok).constraint(SOP(regex="[0-9]+")).allowed(np.zeros(3, np.int32))
