"""A real `jpaged serve` (subprocess, 127.0.0.1, free port) driven by the official openai client.

Answers are checked against the offline `jpaged.LLM` on the same model: greedy texts must be equal,
seeded samples too (draws depend on the seed, the sample index and the position only).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from jpaged import LLM, SamplingParams
from tests.helpers.server import MODEL, metric, metrics

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:", "    def __init__(self):"]


def greedy(llm: LLM, prompt: str, max_tokens: int, **kw) -> str:
    return llm.generate(prompt, SamplingParams(max_tokens=max_tokens, **kw), use_tqdm=False)[0].outputs[0].text


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.base_url + "/health").status_code == 200
    names = metrics(server.base_url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_requests_swapped",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:request_time_per_output_token_seconds_count",
                 "vllm:e2e_request_latency_seconds_count"):
        assert any(k.startswith(name) for k in names), name


def test_completion_streamed_equals_whole_equals_offline(client, offline):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert whole.choices[0].text == streamed == greedy(offline, PROMPTS[0], 24)
    assert whole.choices[0].finish_reason == [c for c in chunks if c.choices][-1].choices[0].finish_reason
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens
    assert whole.usage.prompt_tokens == len(offline.get_tokenizer().encode(PROMPTS[0]))


def test_chat_streamed_equals_whole_equals_offline(client, offline):
    messages = [{"role": "user", "content": "Return the absolute value of x."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    expected = offline.chat(messages, SamplingParams(max_tokens=20), use_tqdm=False)[0].outputs[0].text
    assert whole.choices[0].message.content == streamed == expected
    assert whole.choices[0].message.role == "assistant"


def test_n2_seeded_samples_equal_offline(client, offline):
    params = {"temperature": 0.9, "top_p": 0.95, "max_tokens": 16}
    response = client.completions.create(model=MODEL, prompt=PROMPTS[2], n=2, seed=1234, **params)
    texts = [c.text for c in sorted(response.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(response.choices, key=lambda c: c.index)] == [0, 1]
    expected = offline.generate(PROMPTS[2], SamplingParams(n=2, seed=1234, **params), use_tqdm=False)[0]
    assert texts == [c.text for c in expected.outputs]
    assert texts[0] != texts[1]  # two samples, not one twice
    again = client.completions.create(model=MODEL, prompt=PROMPTS[2], n=2, seed=1234, **params)
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == texts


def test_stop_strings_cut_the_text_streamed_or_not(client, offline):
    kw = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0, "stop": ["\n\n", "return"]}
    whole = client.completions.create(**kw).choices[0]
    chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
    expected = offline.generate(PROMPTS[0], SamplingParams(max_tokens=60, stop=("\n\n", "return")),
                                use_tqdm=False)[0].outputs[0]
    assert whole.finish_reason == "stop" and whole.stop_reason in ("\n\n", "return")
    assert whole.text == "".join(c.choices[0].text for c in chunks) == expected.text
    assert "\n\n" not in whole.text and "return" not in whole.text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_completions_and_chat(client):
    response = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0, logprobs=2)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == response.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 2 and max(top.values()) == pytest.approx(logprob)  # greedy: the best
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Sort a list."}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)


def test_16_concurrent_clients_all_answered_correctly(server, offline):
    prompts = [f"def function_{i}(x):" for i in range(16)]
    expected = [o.outputs[0].text for o in offline.generate(prompts, SamplingParams(max_tokens=20), use_tqdm=False)]
    aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)

    async def ask(i: int) -> str:
        if i % 2:
            stream = await aclient.completions.create(model=MODEL, prompt=prompts[i], max_tokens=20, temperature=0,
                                                      stream=True)
            return "".join([c.choices[0].text async for c in stream if c.choices])
        response = await aclient.completions.create(model=MODEL, prompt=prompts[i], max_tokens=20, temperature=0)
        return response.choices[0].text

    async def everyone() -> list[str]:
        async with aclient:
            return await asyncio.gather(*(ask(i) for i in range(16)))

    assert asyncio.run(everyone()) == expected


def _wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, client):
    before = metrics(server.base_url)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=480, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert metric(metrics(server.base_url), "vllm:kv_cache_usage_perc") > 0  # it holds blocks now
    stream.close()  # the client goes away mid-stream

    def aborted() -> bool:
        now = metrics(server.base_url)
        return (metric(now, "vllm:request_success_total", finished_reason="abort")
                == metric(before, "vllm:request_success_total", finished_reason="abort") + 1
                and metric(now, "vllm:num_requests_running") == 0
                and metric(now, "vllm:kv_cache_usage_perc") == 0)

    assert _wait_for(aborted), metrics(server.base_url)
    after = metrics(server.base_url)
    assert metric(after, "vllm:request_success_total", finished_reason="length") == \
        metric(before, "vllm:request_success_total", finished_reason="length")


def test_a_client_that_leaves_before_its_whole_body_costs_one_info_line(server, client):
    start = len(server.log())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"x\"")  # 1000 bytes announced, 13 sent
    said = "disconnected before sending its whole body"
    assert _wait_for(lambda: said in server.log()[start:], timeout=30), server.log()[start:]
    time.sleep(0.5)  # anything logged after the handler (uvicorn's "Exception in ASGI application") shows by now
    lines = server.log()[start:].splitlines()
    assert [line.split(" ", 1)[0] for line in lines if said in line] == ["INFO"], lines
    assert not any("Traceback" in line or line.startswith("ERROR") for line in lines), lines
    assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2).choices[0].text  # served on


def test_a_stop_token_id_keeps_its_id_not_its_text_streamed_or_not(client, offline):
    newline = offline.get_tokenizer().encode("\n", add_special_tokens=False)
    # vLLM's request from the report: the "\n" that stops a greedy completion is not in its text
    params = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=40, temperature=0,
                  extra_body={"min_tokens": 20, "stop_token_ids": newline})
    whole = client.completions.create(**params).choices[0]
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**params, stream=True)
                       if chunk.choices)
    expected = offline.generate(PROMPTS[1], SamplingParams(max_tokens=40, min_tokens=20, stop_token_ids=newline),
                                use_tqdm=False)[0].outputs[0]
    assert expected.finish_reason == "stop" and expected.token_ids[-1] == newline[0]
    assert whole.finish_reason == "stop" and whole.stop_reason == newline[0]
    assert whole.text == streamed == expected.text == offline.get_tokenizer().decode(expected.token_ids[:-1])


BAD_REQUESTS = [  # (route, body, param the error must name)
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 10_000}, "max_tokens"),
    ("completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ("completions", {"prompt": "x", "no_such_field": 1}, "no_such_field"),
    ("completions", {"prompt": [1, 2, 99_999]}, "prompt"),
    ("completions", {"prompt": "word " * 600}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"max_tokens": 5}, "prompt"),
    ("completions", {"prompt": "x", "n": 64}, "n"),
    ("completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat/completions", {"messages": [{"role": "tool", "content": "hi"}]}, "messages"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
]


def test_bad_requests_get_400_naming_the_field_while_others_are_served(server, offline):
    good = {}

    def long_stream():
        body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 64, "temperature": 0, "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=120) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        good["events"] = events

    runner = threading.Thread(target=long_stream)
    runner.start()
    url = server.base_url + "/v1/"
    for route, body, param in BAD_REQUESTS:
        response = httpx.post(url + route, json={"model": MODEL, **body}, timeout=60)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and param in error["message"], (body, error)
        assert error["type"] == "invalid_request_error"
    broken = httpx.post(url + "completions", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    wrong_model = httpx.post(url + "completions", json={"model": "gpt-4", "prompt": "x"})
    assert wrong_model.status_code == 404 and wrong_model.json()["error"]["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=url, api_key="unused", max_retries=0).completions.create(
            model=MODEL, prompt="x", temperature=5)
    runner.join(120)
    assert good["events"][-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in good["events"][:-1])
    assert text == greedy(offline, PROMPTS[3], 64)
    assert httpx.get(server.base_url + "/health").status_code == 200
