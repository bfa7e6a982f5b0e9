"""The request contract, with the official openai client against a real `jpaged serve`.

Every field OpenAI's and vLLM's clients send is accepted at its neutral value (the answer is the
same as without it), honoured, or refused with a 400 naming it; types are strict; every failure
is OpenAI's error object; text that cannot be encoded is a 400 naming where it is.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from jpaged import SamplingParams
from tests.helpers.server import MODEL

PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "user", "content": "Return the absolute value of x."}]

# What vLLM's and OpenAI's clients send when they ask for nothing (vllm bench serve sends
# repetition_penalty 1.0; the openai client sends whatever the caller passes).
NEUTRAL_COMPLETION = {"best_of": 1, "echo": False, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                      "logit_bias": {}, "user": "someone", "suffix": None}
NEUTRAL_COMPLETION_EXTRA = {
    "repetition_penalty": 1.0, "min_tokens": 0, "min_p": 0.0, "use_beam_search": False, "prompt_logprobs": None,
    "top_k": -1, "allowed_token_ids": None, "bad_words": [], "spaces_between_special_tokens": True, "priority": 0,
    "response_format": {"type": "text"}, "structured_outputs": None, "watermarking": False,
    "kv_transfer_params": None, "ec_transfer_params": None, "vllm_xargs": {}, "repetition_detection": None,
    "thinking_token_budget": -1, "routed_experts_prompt_start": 0, "session_id": "s-1",
    "return_token_offsets": False, "mm_payload": "tensors", "stream_interval": 1, "logprob_token_ids": None,
    "prompt_embeds": None, "length_penalty": 1.0, "include_stop_str_in_output": False, "skip_special_tokens": True,
    "ignore_eos": False, "stop_token_ids": [], "truncate_prompt_tokens": None, "add_special_tokens": True}
NEUTRAL_CHAT = {"store": False, "metadata": {}, "service_tier": "auto", "parallel_tool_calls": True,
                "reasoning_effort": None, "response_format": {"type": "text"}, "logprobs": False, "top_logprobs": 0,
                "modalities": ["text"], "prompt_cache_key": "k", "safety_identifier": "sid", "verbosity": "medium",
                "frequency_penalty": 0.0, "presence_penalty": 0.0, "logit_bias": {}, "user": "someone",
                "prompt_cache_retention": "in_memory"}
NEUTRAL_CHAT_EXTRA = {
    "repetition_penalty": 1.0, "min_tokens": 0, "min_p": 0.0, "use_beam_search": False, "prompt_logprobs": None,
    "chat_template_kwargs": {}, "continue_final_message": False, "add_generation_prompt": True, "echo": False,
    "include_reasoning": True, "documents": None, "chat_template": None, "media_io_kwargs": None,
    "mm_processor_kwargs": None, "function_call": "none", "functions": None, "bad_words": [],
    "allowed_token_ids": None, "add_special_tokens": False}


def error_of(exc: openai.APIStatusError) -> dict:
    """The OpenAI error object of a failed call."""
    body = exc.body
    return body.get("error", body) if isinstance(body, dict) else {}


def test_neutral_values_are_accepted_and_change_nothing(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    neutral = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                        extra_body=NEUTRAL_COMPLETION_EXTRA, **NEUTRAL_COMPLETION)
    assert neutral.choices[0].text == plain.choices[0].text and neutral.usage == plain.usage
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    neutral = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                             extra_body=NEUTRAL_CHAT_EXTRA, **NEUTRAL_CHAT)
    assert neutral.choices[0].message.content == plain.choices[0].message.content and neutral.usage == plain.usage


REFUSED = [  # (route, field, value, extra fields): each is a 400 whose param names the field
    # out of range, whatever the support
    ("completions", "presence_penalty", 3.0, {}),
    ("completions", "logit_bias", {"x": 1.0}, {}),
    ("completions", "best_of", 1, {"n": 2}),
    ("completions", "best_of", 3, {"stream": True}),  # the 3 are ranked at the end
    ("completions", "best_of", 40, {}),  # wider than max_num_seqs (the engine's door)
    ("completions", "logit_bias", {"999999": 1.0}, {}),  # not in the vocabulary (the engine's door)
    ("chat", "allowed_token_ids", [10**6], {}),
    ("completions", "min_tokens", 9, {}),  # more than max_tokens (4)
    ("chat", "repetition_penalty", 0.0, {}),
    # later (other branches) or never: neutral only
    ("completions", "prompt_logprobs", 1, {"stream": True}),  # honoured, but whole: not streamed
    ("completions", "max_tokens", 0, {}),  # only with echo
    ("completions", "suffix", "tail", {}),
    ("completions", "priority", 1, {}),
    ("completions", "logprob_token_ids", [1], {"logprobs": 1}),
    ("completions", "spaces_between_special_tokens", False, {}),
    ("completions", "stream_interval", 100, {}),
    ("chat", "store", True, {}),
    ("chat", "service_tier", "flex", {}),
    ("chat", "modalities", ["text", "audio"], {}),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}, {}),
    ("chat", "prediction", {"type": "content", "content": "x"}, {}),
    ("chat", "chat_template", "{{ messages }}", {}),
    ("chat", "chat_template_kwargs", {"messages": []}, {}),
    ("chat", "tool_choice", "auto", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("chat", "tool_choice", None, {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("chat", "echo", True, {}),
    ("chat", "top_logprobs", 2, {}),
    ("chat", "continue_final_message", True, {}),  # with add_generation_prompt left true
    ("completions", "use_beam_search", True, {"stream": True}),
]


@pytest.mark.parametrize(("route", "field", "value", "extra"), REFUSED,
                         ids=[f"{r}-{f}-{json.dumps(v)[:20]}" for r, f, v, _ in REFUSED])
def test_fields_not_supported_are_refused_naming_them(client, route, field, value, extra):
    body = {field: value, **extra}
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "completions":
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body=body)
        else:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=body)
    error = error_of(caught.value)
    param = error["param"]  # the field, or a key inside it ("chat_template_kwargs.messages")
    assert (param == field or param.startswith(field + ".")) and error["message"].startswith(f"{param}:"), error
    assert error["type"] == "invalid_request_error" and error["code"] == 400


@pytest.mark.parametrize(("field", "value"), [("max_tokens", True), ("temperature", True), ("n", True),
                                              ("logprobs", True), ("top_p", "0.5"), ("seed", "7"),
                                              ("max_tokens", "16"), ("max_tokens", 16.5), ("stop", 5),
                                              ("stream", "true")])
def test_types_are_strict_no_bool_as_a_number_no_number_as_a_string(client, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={field: value})
    error = error_of(caught.value)
    assert error["param"] == field and error["message"].startswith(f"{field}:"), error


def test_chats_bool_fields_take_no_numbers(client):
    for field, value in (("logprobs", 1), ("add_generation_prompt", 0), ("stream", 1)):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={field: value})
        assert error_of(caught.value)["param"] == field


def test_every_failure_is_openais_error_object(server):
    url = server.base_url
    json_type = {"content-type": "application/json"}
    cases = [  # (method, path, body, headers, status, words in the message)
        ("POST", "/v1/completions", b'{"prompt": "x"', json_type, 400, "not valid JSON"),
        ("POST", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', json_type, 400, "NaN"),
        ("POST", "/v1/completions", b'["x"]', json_type, 400, "JSON object"),
        ("POST", "/v1/completions", b"\xff\xfe", json_type, 400, "not valid JSON"),
        ("POST", "/v1/completions", b'{"prompt": "x"}', {"content-type": "text/plain"}, 400, "Content-Type"),
        ("POST", "/v1/chat/completions", b"prompt=x", {"content-type": "application/x-www-form-urlencoded"}, 400,
         "Content-Type"),
        ("POST", "/tokenize", b'{"prompt": "x"}', {}, 400, "Content-Type"),
        ("GET", "/v1/no-such-route", None, {}, 404, "Not Found"),
        ("GET", "/v1/completions", None, {}, 405, "Method Not Allowed"),
    ]
    for method, path, body, headers, status, words in cases:
        response = httpx.request(method, url + path, content=body, headers=headers, timeout=30)
        assert response.status_code == status, (path, body, response.text)
        payload = response.json()
        assert set(payload) == {"error"} and "detail" not in payload, payload
        assert set(payload["error"]) == {"message", "type", "param", "code"} and payload["error"]["code"] == status
        assert words in payload["error"]["message"], payload


def _post_raw(server, route: str, body: dict) -> httpx.Response:
    """POST `body` as ASCII JSON: a lone surrogate becomes the escape "\\ud800", as any JSON encoder
    writes it (the openai client cannot send one: its UTF-8 encoder refuses the character)."""
    return httpx.post(f"{server.base_url}/v1/{route}", content=json.dumps({"model": MODEL, **body}),
                      headers={"content-type": "application/json"}, timeout=60)


def test_text_that_cannot_be_encoded_is_a_400_naming_where_it_is(server, client):
    cases = [
        ("completions", {"prompt": "abc\ud800def", "max_tokens": 2}, "prompt"),
        ("completions", {"prompt": ["fine", "x\udfff"], "max_tokens": 2}, "prompt[1]"),
        ("chat/completions", {"messages": [{"role": "system", "content": "ok"},
                                           {"role": "user", "content": "bad \ud83d here"}]}, "messages[1].content"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
         "messages[0].content[0].text"),
    ]
    for route, body, param in cases:
        response = _post_raw(server, route, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and error["message"].startswith(f"{param}: is not valid Unicode text"), error
    # a surrogate pair escaped in JSON is one ordinary character: served
    assert _post_raw(server, "completions", {"prompt": "emoji \ud83d\ude00", "max_tokens": 2}).status_code == 200
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                     extra_body={"ignore_eos": True}).choices[0].finish_reason == "length"


def test_continuous_usage_stats_give_usage_in_every_chunk(client):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    prompt_tokens = chunks[-1].usage.prompt_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    seen = [c.usage.completion_tokens for c in with_choices]
    assert all(c.usage.prompt_tokens == prompt_tokens for c in with_choices)
    assert seen == sorted(seen) and seen[-1] == 6 and len(set(seen)) == len(seen)
    chat = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0,
                                               stream=True, stream_options={"include_usage": True,
                                                                            "continuous_usage_stats": True}))
    assert [c.usage.completion_tokens for c in chat if c.choices and c.choices[0].delta.content][-1] == 4
    without = [c for c in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                                    stream_options={"include_usage": True}) if c.choices]
    assert all(c.usage is None for c in without)


def test_developer_messages_are_system_messages_for_a_template_without_the_role(client):
    def answer(messages):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                              extra_body={"return_prompt_text": True})

    as_developer = answer([{"role": "developer", "content": "Be brief."}, *MESSAGES])
    as_system = answer([{"role": "system", "content": "Be brief."}, *MESSAGES])
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.model_extra["prompt_text"] == as_system.model_extra["prompt_text"]
    # a system and a developer message merge into one first system message (the template allows one)
    both = answer([{"role": "system", "content": "A."}, *MESSAGES, {"role": "developer", "content": "B."}])
    assert both.model_extra["prompt_text"].startswith("<|bos|><|im_start|>system\nA.\n\nB.<|im_end|>\n")


def test_tools_with_tool_choice_none_reach_the_template_and_no_tool_is_called(client):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0,
                                                tools=tools, tool_choice="none", parallel_tool_calls=False)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    # The asset's template does not render tools: the same prompt, the same answer, no tool call.
    assert with_tools.choices[0].message.content == plain.choices[0].message.content
    assert with_tools.choices[0].message.tool_calls is None


def test_vllms_prompt_and_output_extensions_are_honoured(client, offline):
    tok = offline.get_tokenizer()
    ids = tok.encode(PROMPT)
    cut = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True})
    assert cut.usage.prompt_tokens == 3 and cut.choices[0].model_extra["prompt_token_ids"] == ids[-3:]
    expected = offline.generate(ids[-3:], SamplingParams(max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert cut.choices[0].text == expected.text and cut.choices[0].model_extra["token_ids"] == expected.token_ids
    no_bos = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                       extra_body={"add_special_tokens": False})
    assert no_bos.usage.prompt_tokens == len(ids) - 1 and ids[0] == tok.bos_token_id
    named = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logprobs=1,
                                      extra_body={"request_id": "mine-1", "return_tokens_as_token_ids": True})
    assert named.id == "cmpl-mine-1"
    assert all(t.startswith("token_id:") for t in named.choices[0].logprobs.tokens)
    chat = client.chat.completions.create(
        model=MODEL, messages=[*MESSAGES, {"role": "assistant", "content": "def absolute(x):"}], max_tokens=4,
        temperature=0, extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                   "return_prompt_text": True, "chat_template_kwargs": {"unused_variable": 1}})
    assert chat.model_extra["prompt_text"].endswith("<|im_start|>assistant\ndef absolute(x):")


def test_beam_search_through_the_server_equals_offline(client, offline):
    response = client.completions.create(model=MODEL, prompt=PROMPT, n=2, max_tokens=8,
                                         extra_body={"use_beam_search": True, "length_penalty": 1.0})
    expected = offline.generate(PROMPT, SamplingParams(n=2, use_beam_search=True, max_tokens=8), use_tqdm=False)[0]
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == [c.text for c in expected.outputs]


def _ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_sampling_controls_are_honoured_as_offline(client, offline):
    """Each control reaches the engine: the server's tokens equal the offline engine's under the same
    SamplingParams, and the control shows its effect."""
    tok = offline.get_tokenizer()
    x, y = tok.encode("x", add_special_tokens=False)[0], tok.encode(" y", add_special_tokens=False)[0]
    controls = {  # request fields -> SamplingParams fields (the same names)
        "presence_penalty": {"presence_penalty": 2.0},
        "frequency_penalty": {"frequency_penalty": 2.0},
        "repetition_penalty": {"repetition_penalty": 2.0},
        "min_p": {"min_p": 0.2, "temperature": 1.0, "seed": 11},
        "bad_words": {"bad_words": [" return", "fib"]},
    }
    base = {"max_tokens": 24, "temperature": 0.0}
    plain = _ids(client.completions.create(model=MODEL, prompt=PROMPT, **base,
                                           extra_body={"return_token_ids": True}).choices[0])
    for name, fields in controls.items():
        got = client.completions.create(model=MODEL, prompt=PROMPT, **base,
                                        extra_body={**fields, "return_token_ids": True})  # JSON as given
        params = {**base, **fields, "bad_words": tuple(fields.get("bad_words", ()))}
        expected = offline.generate(PROMPT, SamplingParams(**params), use_tqdm=False)[0].outputs[0]
        assert _ids(got.choices[0]) == list(expected.token_ids), name
    penalised = client.completions.create(model=MODEL, prompt=PROMPT, **base, frequency_penalty=2.0,
                                          extra_body={"return_token_ids": True})
    assert _ids(penalised.choices[0]) != plain  # the penalty changed the greedy text
    banned = client.completions.create(model=MODEL, prompt=PROMPT, **base, extra_body={"bad_words": ["fib"]})
    assert "fib" not in banned.choices[0].text
    # logit_bias and allowed_token_ids force tokens, on both routes
    forced = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logit_bias={str(x): 100},
                                       extra_body={"return_token_ids": True})
    assert _ids(forced.choices[0]) == [x] * 5
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, seed=3,
                                          extra_body={"allowed_token_ids": [x, y], "return_token_ids": True})
    assert set(_ids(chat.choices[0])) <= {x, y} and len(_ids(chat.choices[0])) == 6


def test_min_tokens_delays_the_stop_tokens(client):
    def complete(**extra):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                         extra_body={"return_token_ids": True, **extra}).choices[0]

    ids = _ids(complete())
    stop = next(t for i, t in enumerate(ids) if i >= 3 and t not in ids[:i])  # a token the greedy text meets late
    early = complete(stop_token_ids=[stop])
    assert early.finish_reason == "stop" and len(_ids(early)) <= ids.index(stop) + 1
    late = complete(stop_token_ids=[stop], min_tokens=ids.index(stop) + 6)
    assert len(_ids(late)) >= ids.index(stop) + 6  # the stop token could not be sampled before min_tokens


def test_best_of_returns_the_n_best_as_offline(client, offline):
    response = client.completions.create(model=MODEL, prompt=PROMPT, n=2, best_of=4, seed=7, max_tokens=12,
                                         temperature=1.0, logprobs=0)
    params = SamplingParams(n=2, best_of=4, seed=7, max_tokens=12, temperature=1.0, logprobs=0)
    expected = offline.generate(PROMPT, params, use_tqdm=False)[0].outputs
    choices = sorted(response.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [c.text for c in expected]
    # ranked by cumulative log-probability, best first
    totals = [sum(c.logprobs.token_logprobs) for c in choices]
    assert totals[0] >= totals[1]
