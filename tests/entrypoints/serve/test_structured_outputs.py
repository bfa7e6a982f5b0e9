"""Structured outputs through a real `jpaged serve` with the official openai client: vLLM's
`structured_outputs` (json, regex, choice, grammar) and OpenAI's `response_format` (json_object,
json_schema) on both routes give the offline LLM's tokens and valid outputs, streamed or whole;
malformed specs are 400s naming the field while the server goes on."""

from __future__ import annotations

import json
import re

import openai
import pytest

from jpaged import SamplingParams, StructuredOutputsParams
from tests.helpers.json_schema import errors
from tests.helpers.server import MODEL

PROMPT = "def parse(data):\n    return "
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
REGEX = r"[a-z]{1,8}_[0-9]{2}"
CHOICES = ["True", "False", "None"]
GRAMMAR = 'start: "def " NAME "(" NAME? ")" ":"\nNAME: /[a-z_]+/'


def offline_texts(llm, prompt, spec, **kw):
    out = llm.generate(prompt, SamplingParams(structured_outputs=spec, **kw), use_tqdm=False)[0]
    return [(c.text, c.finish_reason) for c in out.outputs]


def _valid_json(text):
    return errors(json.loads(text), SCHEMA) == []


# request field value -> (the offline spec, whether a finished text is valid)
FORMS = {
    "json": ({"json": SCHEMA, "disable_any_whitespace": True},
             StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), _valid_json),
    "regex": ({"regex": REGEX}, StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
    "choice": ({"choice": CHOICES}, StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
    "grammar": ({"grammar": GRAMMAR}, StructuredOutputsParams(grammar=GRAMMAR),
                lambda t: re.fullmatch(r"def [a-z_]+\(([a-z_]+)?\):", t)),
}


@pytest.mark.parametrize("form", FORMS)
def test_structured_outputs_on_completions_equal_offline_and_are_valid(client, offline, form):
    field, spec, valid = FORMS[form]
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0,
                                      extra_body={"structured_outputs": field})
    seeded = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=1.0, seed=7, n=2,
                                       extra_body={"structured_outputs": field})
    got = [(c.text, c.finish_reason) for c in whole.choices]
    assert got == offline_texts(offline, PROMPT, spec, max_tokens=48)
    assert [(c.text, c.finish_reason) for c in seeded.choices] == offline_texts(
        offline, PROMPT, spec, max_tokens=48, temperature=1.0, seed=7, n=2)
    assert got[0][1] == "stop"
    for c in [*whole.choices, *seeded.choices]:
        assert c.finish_reason == "length" or valid(c.text), c.text


def test_structured_outputs_on_chat_streamed_equal_whole(client, offline):
    messages = [{"role": "user", "content": "Name a variable."}]
    kw = {"model": MODEL, "messages": messages, "max_tokens": 32, "temperature": 0,
          "extra_body": {"structured_outputs": {"regex": REGEX}}}
    whole = client.chat.completions.create(**kw)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                       if c.choices)
    text = whole.choices[0].message.content
    assert text == streamed and re.fullmatch(REGEX, text) and whole.choices[0].finish_reason == "stop"
    prompt = offline.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert [(text, "stop")] == offline_texts(offline, prompt, StructuredOutputsParams(regex=REGEX), max_tokens=32)


def test_response_format_on_both_routes(client, offline):
    messages = [{"role": "user", "content": "Describe a person."}]
    prompt = offline.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                          response_format=schema_format)
    # response_format has no whitespace option (free whitespace, vLLM's default): on this code model the
    # output may run to max_tokens; the same as offline either way, and valid when it says "stop".
    c = chat.choices[0]
    assert [(c.message.content, c.finish_reason)] == offline_texts(
        offline, prompt, StructuredOutputsParams(json=SCHEMA), max_tokens=40)
    assert c.finish_reason == "length" or _valid_json(c.message.content)
    obj = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})
    assert [(obj.choices[0].text, obj.choices[0].finish_reason)] == offline_texts(
        offline, PROMPT, StructuredOutputsParams(json_object=True), max_tokens=40)
    assert isinstance(json.loads(obj.choices[0].text), dict) and obj.choices[0].finish_reason == "stop"
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text == offline.generate(PROMPT, SamplingParams(max_tokens=8),
                                                    use_tqdm=False)[0].outputs[0].text


def test_a_schema_not_finished_within_max_tokens_ends_with_length(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                    extra_body={"structured_outputs": {"json": SCHEMA}})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.choices[0].text)


BAD = [
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}},
     "response_format.json_schema.schema", "Unsatisfiable"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema", "strin"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "required"),
    ("chat", {"response_format": {"type": "json_schema"}}, "response_format.json_schema", "required"),
    ("completions", {"response_format": {"type": "structural_tag"}}, "response_format.type", "json_schema"),
    ("completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "unclosed group"),
    ("chat", {"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar", "unknown name"),
    ("completions", {"structured_outputs": {"json": "{not json"}}, "structured_outputs.json", "not valid JSON"),
    ("completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "regex and choice"),
    ("completions", {"structured_outputs": {}}, "structured_outputs", "none"),
    ("chat", {"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least one"),
    ("chat", {"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern",
     "unrecognized"),
    ("completions", {"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "string"),
    ("chat", {"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}},
     "structured_outputs", "not both"),
]


@pytest.mark.parametrize("route, extra, param, reason", BAD, ids=[f"{r}-{p}-{i}" for i, (r, _, p, _) in enumerate(BAD)])
def test_malformed_specs_are_400s_naming_the_field(client, route, extra, param, reason):
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="x = ", max_tokens=4, extra_body=extra)
    error = caught.value.response.json()["error"]
    assert error["param"] == param and reason in error["message"], error
    # (the server still serves; ignore_eos: a sampled end of text within 2 tokens would read "stop")
    assert client.completions.create(model=MODEL, prompt="x = ", max_tokens=2,
                                     extra_body={"ignore_eos": True}).choices[0].finish_reason == "length"
