"""Completions `echo` and `prompt_logprobs` (completions and chat) from a real `jpaged serve`, in vLLM's
shapes, their numbers equal to the offline LLM's prompt log-probabilities on the same model (the
session's server and offline LLM, conftest.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from jpaged import SamplingParams
from tests.helpers.server import MODEL

PROMPT = "def fibonacci(n):\n    if n < 2:"


@pytest.fixture(scope="module")
def echoed(offline):
    """(the session's offline LLM, its output for PROMPT with prompt_logprobs=2 and one greedy token)."""
    out = offline.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2, logprobs=2),
                           use_tqdm=False)[0]
    return offline, out


def _post(server, route, body):
    response = httpx.post(f"{server.base_url}/v1/{route}", json={"model": MODEL, **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _check_prompt_part(lp, out, strings):
    """The legacy logprobs' prompt positions against the offline output `out`."""
    ids = out.prompt_token_ids
    assert lp["tokens"][: len(ids)] == strings
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for t in range(1, len(ids)):
        assert lp["token_logprobs"][t] == pytest.approx(out.prompt_logprobs[t][ids[t]], abs=1e-6)
        assert len(lp["top_logprobs"][t]) <= 3  # the prompt's token and the top 2
    offsets = [0]
    for token in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp["text_offset"] == offsets


def test_echo_with_logprobs_max_tokens_1_and_0(server, echoed):
    llm, out = echoed
    ids = out.prompt_token_ids
    strings = [llm.get_tokenizer().decode([t], skip_special_tokens=False) for t in ids]
    one = _post(server, "completions", {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 1,
                                        "temperature": 0})
    choice = one["choices"][0]
    assert choice["text"] == PROMPT + out.outputs[0].text
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    _check_prompt_part(lp, out, strings)
    assert lp["token_logprobs"][-1] == pytest.approx(out.outputs[0].logprobs[0][out.outputs[0].token_ids[0]], abs=1e-6)
    # vLLM's choice also carries prompt_logprobs: {id: {logprob, rank, decoded_token}}, None first.
    plp = choice["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    first = plp[1][str(ids[1])]
    assert first["rank"] == out.prompt_ranks[1] and first["logprob"] == pytest.approx(out.prompt_logprobs[1][ids[1]])
    assert one["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}

    zero = _post(server, "completions", {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 0})
    choice = zero["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    _check_prompt_part(choice["logprobs"], out, strings)
    assert zero["usage"]["completion_tokens"] == 1  # as vLLM counts it: the engine computed one token


def test_echo_without_logprobs_and_streamed(server, client, echoed):
    _, out = echoed
    plain = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, max_tokens=4, temperature=0)
    whole = plain.choices[0].text
    assert whole.startswith(PROMPT) and plain.choices[0].logprobs is None
    events = []
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "max_tokens": 4, "temperature": 0, "stream": True,
            "logprobs": 1}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events) == whole
    tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for e in events for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert len(tokens) == len(out.prompt_token_ids) + 4
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]  # continuous across chunks


def test_batch_of_token_id_prompts_as_lm_eval_sends_them(server, echoed):
    """lm-eval's log-likelihood request: token-id prompts, echo, logprobs 1, max_tokens 1."""
    llm, out = echoed
    ids = out.prompt_token_ids
    prompts = [ids, ids[:5], ids[3:]]
    answer = _post(server, "completions", {"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                                           "temperature": 0})
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    for prompt, choice in zip(prompts, answer["choices"]):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) + 1
        want = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        # (Batched with the others the step's padded shape differs: float32 sums may round apart.)
        assert lp["token_logprobs"][1:-1] == pytest.approx(
            [want.prompt_logprobs[t][prompt[t]] for t in range(1, len(prompt))], abs=1e-5)
        assert choice["text"].startswith(llm.get_tokenizer().decode(prompt, skip_special_tokens=False))


def test_chat_prompt_logprobs(server):
    answer = _post(server, "chat/completions", {"messages": [{"role": "user", "content": "Sort a list."}],
                                                "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3})
    plp = answer["prompt_logprobs"]
    assert plp[0] is None and len(plp) == answer["usage"]["prompt_tokens"]
    for entry in plp[1:]:
        assert 1 <= len(entry) <= 4
        ranks = sorted(v["rank"] for v in entry.values())
        assert ranks[:3] == [1, 2, 3] or ranks[-1] > 3
        assert all(v["logprob"] <= 0 and isinstance(v["decoded_token"], str) for v in entry.values())


@pytest.mark.parametrize("route,body,param", [
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 2.5}, "prompt_logprobs"),
    ("completions", {"prompt": "x", "prompt_logprobs": True}, "prompt_logprobs"),  # a bool is not an int
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": False},
     "prompt_logprobs"),
    ("completions", {"prompt": "x", "echo": 1}, "echo"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "echo": True}, "echo"),  # chat's echo
])
def test_bad_prompt_logprobs_and_echo_requests_name_the_field(server, route, body, param):
    response = httpx.post(f"{server.base_url}/v1/{route}", json={"model": MODEL, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}:"), error
    assert error["type"] == "invalid_request_error" and error["code"] == 400


def test_echo_of_a_truncated_prompt_is_what_the_engine_saw(server, echoed):
    """truncate_prompt_tokens keeps the prompt's end: the echo is those tokens decoded, not the text sent."""
    llm, out = echoed
    kept = out.prompt_token_ids[-4:]
    answer = _post(server, "completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 0,
                                           "truncate_prompt_tokens": 4})
    choice = answer["choices"][0]
    assert choice["text"] == llm.get_tokenizer().decode(kept, skip_special_tokens=False)
    assert len(choice["logprobs"]["tokens"]) == 4 and answer["usage"]["prompt_tokens"] == 4
