"""Structured outputs through the offline API on the asset model (a small Python-code LM: its
constrained outputs are odd, but must be valid): every form greedy and seeded, "length" when the
grammar cannot be finished in max_tokens, malformed specs refused by name before anything runs, a
seeded grammar request the same alone and in a crowd under preemption."""

import json
import re

import pytest

from jpaged import LLM, SamplingParams, StructuredOutputsParams
from jpaged.text.structured_output import compiler_for
from tests.helpers.json_schema import errors
from tests.helpers.text_assets import ASSET

PROMPT = "def parse(data):\n    return "
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "kind": {"enum": ["cat", "dog"]},
    "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
    "required": ["name", "age", "kind", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{1,8}_[0-9]{2}"
CHOICES = ["True", "False", "None"]
LARK = 'start: "def " NAME "(" NAME? ")" ":"\nNAME: /[a-z_]+/'
LARK_AS_RE = r"def [a-z_]+\(([a-z_]+)?\):"
GBNF = 'root ::= "x = " [0-9]{1,4} ("." [0-9]{1,3})?'
GBNF_AS_RE = r"x = [0-9]{1,4}(\.[0-9]{1,3})?"


def _json_valid(text):
    try:
        return errors(json.loads(text), SCHEMA) == []
    except json.JSONDecodeError:
        return False


def _json_object(text):
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


# form -> (spec, max_tokens, whether a text is valid). The JSON schemas without whitespace: with
# flexible whitespace (the default) this code model writes newlines between a key and its colon
# until max_tokens (the "length" test below shows it); bounded regexes for the same reason.
FORMS = {
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), 64, _json_valid),
    "json-text": (StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True), 64, _json_valid),
    "json_object": (StructuredOutputsParams(json_object=True), 64, _json_object),
    "regex": (StructuredOutputsParams(regex=REGEX), 32, lambda t: re.fullmatch(REGEX, t) is not None),
    "choice": (StructuredOutputsParams(choice=CHOICES), 8, lambda t: t in CHOICES),
    "lark": (StructuredOutputsParams(grammar=LARK), 32, lambda t: re.fullmatch(LARK_AS_RE, t) is not None),
    "gbnf": (StructuredOutputsParams(grammar=GBNF), 32, lambda t: re.fullmatch(GBNF_AS_RE, t) is not None),
}


@pytest.fixture(scope="module")
def llm():
    return LLM(str(ASSET), num_blocks=128, block_size=16, max_num_seqs=16, attention_backend="xla", warmup=False)


def free_blocks(llm):
    stats = llm.engine.kv_stats()
    return stats["num_free_blocks"] == stats["num_total_blocks"] and not llm.engine.has_unfinished()


@pytest.mark.parametrize("form", FORMS)
def test_every_form_is_valid_greedy_and_seeded(llm, form):
    spec, max_tokens, valid = FORMS[form]
    greedy, seeded = llm.generate([PROMPT, PROMPT], [
        SamplingParams(max_tokens=max_tokens, structured_outputs=spec),
        SamplingParams(n=3, max_tokens=max_tokens, temperature=1.0, seed=5, structured_outputs=spec)],
        use_tqdm=False)
    # Greedy finishes on the asset model (measured); a seeded sample may run out of tokens, but
    # whatever says "stop" is complete and valid.
    assert greedy.outputs[0].finish_reason == "stop", greedy.outputs[0].text
    finished = [c for c in [*greedy.outputs, *seeded.outputs] if c.finish_reason == "stop"]
    assert len(finished) >= 2
    for c in finished:
        assert valid(c.text), (form, c.text)
    for c in seeded.outputs:
        assert c.finish_reason in ("stop", "length") and len(c.token_ids) <= max_tokens
    assert free_blocks(llm)


@pytest.mark.parametrize("spec", [
    StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string", "minLength": 40}},
                                  "required": ["name"]}, disable_any_whitespace=True),
    StructuredOutputsParams(json=SCHEMA),  # flexible whitespace: the model writes newlines until the end
], ids=["too-long", "whitespace"])
def test_what_is_not_finished_within_max_tokens_ends_with_length(llm, spec):
    c = llm.generate(PROMPT, SamplingParams(max_tokens=24, structured_outputs=spec), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 24 and c.text.startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputsParams(json={"type": "integer", "minimum": 3, "maximum": 1}), "structured_outputs.json"),
    (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
    (StructuredOutputsParams(regex="(unclosed"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="start: missing_rule"), "structured_outputs.grammar"),
], ids=["unsatisfiable-schema", "schema-text", "regex", "grammar"])
def test_malformed_specs_are_value_errors_naming_the_field(llm, spec, field):
    good = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match=f"^{re.escape(field)}: "):
        llm.generate([PROMPT, PROMPT], [good, SamplingParams(max_tokens=4, structured_outputs=spec)], use_tqdm=False)
    assert free_blocks(llm)  # nothing of the refused batch was queued
    still = SamplingParams(max_tokens=4, ignore_eos=True)  # (a sampled end of text would read "stop")
    assert llm.generate(PROMPT, still, use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_compiled_grammars_are_reused(llm):
    compiler = compiler_for(llm.get_tokenizer())
    spec = StructuredOutputsParams(regex="[0-9]{4}-[0-9]{2}")
    llm.generate([PROMPT] * 3, SamplingParams(max_tokens=12, structured_outputs=spec), use_tqdm=False)
    misses = compiler.misses
    out = llm.generate(PROMPT, SamplingParams(max_tokens=12, structured_outputs=spec), use_tqdm=False)[0]
    assert compiler.misses == misses and re.fullmatch("[0-9]{4}-[0-9]{2}", out.outputs[0].text)


def test_a_seeded_grammar_request_is_the_same_alone_and_in_a_crowd_under_preemption():
    small = LLM(str(ASSET), num_blocks=20, block_size=16, max_num_seqs=8, attention_backend="xla",
                preemption_mode="recompute", warmup=False)
    grammar = SamplingParams(n=2, max_tokens=48, temperature=1.0, seed=21,
                             structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    alone = small.generate(PROMPT, grammar, use_tqdm=False)[0]
    crowd_prompts = [f"import os\n\n\ndef f{i}(path):\n    " + "x = 1\n    " * 8 for i in range(6)]
    crowd = [SamplingParams(max_tokens=64, temperature=0.8, seed=i, ignore_eos=True) for i in range(6)]
    mixed = small.generate([*crowd_prompts[:3], PROMPT, *crowd_prompts[3:]],
                           [*crowd[:3], grammar, *crowd[3:]], use_tqdm=False)
    assert small.engine.kv_stats()["num_preemptions"] > 0
    together = mixed[3]
    assert [c.token_ids for c in together.outputs] == [c.token_ids for c in alone.outputs]
    assert [c.finish_reason for c in together.outputs] == [c.finish_reason for c in alone.outputs]
    for c in together.outputs:
        assert c.finish_reason == "length" or _json_valid(c.text), c.text
