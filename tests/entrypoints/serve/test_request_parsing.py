"""Request bodies parsed at the door (serve/errors.py), without a server: each refusal names the
field at fault, in `param` and at the start of `message`."""

from __future__ import annotations

import json

import pytest

from jpaged.entrypoints.serve.errors import RequestError, parse_body
from jpaged.entrypoints.serve.protocol import ChatCompletionRequest, CompletionRequest

JSON = "application/json"


@pytest.mark.parametrize("body, model, param, constant", [
    # what Python's json.dumps sends for float("nan") / float("inf") by default
    ({"prompt": "def f(x):", "max_tokens": 4, "temperature": float("nan")}, CompletionRequest, "temperature", "NaN"),
    ({"prompt": "x", "top_p": float("inf")}, CompletionRequest, "top_p", "Infinity"),
    ({"prompt": "x", "logit_bias": {"5": float("-inf")}}, CompletionRequest, "logit_bias.5", "-Infinity"),
    ({"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5,
      "stop": ["a", float("nan")]}, ChatCompletionRequest, "stop[1]", "NaN"),
])
def test_nan_and_infinity_name_the_field_that_holds_them(body, model, param, constant):
    with pytest.raises(RequestError) as caught:
        parse_body(json.dumps(body).encode(), JSON, model)
    assert caught.value.param == param and caught.value.status == 400
    assert caught.value.message.startswith(f"{param}: {constant} is not a JSON number"), caught.value.message


def test_a_body_that_is_only_nan_is_refused_as_a_whole():
    with pytest.raises(RequestError) as caught:
        parse_body(b"NaN", JSON, CompletionRequest)
    assert caught.value.param is None and "NaN is not a JSON number" in caught.value.message


def test_the_strings_nan_and_infinity_are_text_not_numbers():
    body = parse_body(json.dumps({"prompt": "NaN", "stop": ["Infinity"]}).encode(), JSON, CompletionRequest)
    assert body.prompt == "NaN"
