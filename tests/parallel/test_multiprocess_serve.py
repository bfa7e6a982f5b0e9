"""`jpaged serve` on 2 processes x 2 virtual CPU devices (tensor parallelism over all 4) answers the
openai client exactly as one process on one device does, greedy and seeded, through swap
preemptions; killing the follower mid-stream ends the stream with the error and turns /health to
503 within the bound, and new requests get 503. A Hugging Face checkpoint split over two processes
answers like the offline LLM, and the follower exits 0 when process 0 stops cleanly."""

from __future__ import annotations

import json
import signal
import time

import pytest

for _module in ("fastapi", "uvicorn", "httpx", "openai"):
    pytest.importorskip(_module, reason=f"{_module} is not installed: pip install -e \".[test]\"")

import httpx
import openai

from jpaged import LLM, SamplingParams
from tests.helpers.server import metric, metrics
from tests.helpers.text_assets import ASSET
from tests.parallel.serve_processes import single, stop, two_processes

PROMPTS = [[1, 2, 3, 4, 5], list(range(1, 40)), list(range(7, 50))]  # together they outgrow the 12-block pool
FOLLOWER_TIMEOUT = 20.0  # the bound under test (a killed follower is seen at once: its connection closes)


def _answers(base_url: str) -> dict:
    """Token ids of greedy and seeded (n = 2) completions of PROMPTS, and the preemptions they caused."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    out = {}
    for name, settings in (("greedy", {"temperature": 0}), ("seeded", {"temperature": 0.8, "seed": 3, "n": 2})):
        response = client.completions.create(model="tiny-llama", prompt=PROMPTS, max_tokens=8, logprobs=0, **settings)
        out[name] = [(c.index, c.logprobs.tokens, c.finish_reason) for c in response.choices]
    out["preemptions"] = metric(metrics(base_url), "vllm:num_preemptions_total")
    return out


@pytest.mark.slow
def test_two_processes_answer_like_one_and_fail_cleanly_when_the_follower_dies(tmp_path):
    with single(tmp_path) as base_url:
        expected = _answers(base_url)
    assert expected["preemptions"] > 0
    with two_processes(tmp_path, "--follower-timeout", str(FOLLOWER_TIMEOUT)) as (base_url, leader, follower):
        assert _answers(base_url) == expected
        body = {"model": "tiny-llama", "prompt": [1, 2, 3], "max_tokens": 80, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                if len(events) == 3:
                    break
            follower.kill()  # mid-stream
            killed = time.monotonic()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
            ended = time.monotonic() - killed
        assert "error" in events[-1] and "process 1 is lost" in events[-1]["error"]["message"], events[-1]
        assert ended < FOLLOWER_TIMEOUT
        health = httpx.get(base_url + "/health", timeout=10)
        assert health.status_code == 503 and "process 1 is lost" in health.text
        refused = httpx.post(base_url + "/v1/completions", json={**body, "stream": False}, timeout=10)
        assert refused.status_code == 503 and "process 1 is lost" in refused.text
        assert leader.poll() is None  # process 0 keeps answering


@pytest.mark.slow
def test_a_hugging_face_checkpoint_split_over_two_processes_answers_like_offline(tmp_path):
    """Each process reads its own shard of the checkpoint (1 device each, tensor parallelism 2);
    greedy texts equal the offline LLM's on one device; a clean stop of process 0 stops the follower."""
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:"]
    llm = LLM(str(ASSET), attention_backend="xla", num_blocks=64, block_size=16, max_num_seqs=16, warmup=False)
    expected = [o.outputs[0].text for o in llm.generate(prompts, SamplingParams(max_tokens=24), use_tqdm=False)]
    engine_args = ["--model", str(ASSET), "--served-model-name", "stdlib-lm", "--attention-backend", "xla",
                   "--num-blocks", "64", "--block-size", "16", "--max-num-seqs", "16"]
    with two_processes(tmp_path, devices=1, engine_args=engine_args) as (base_url, leader, follower):
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        response = client.completions.create(model="stdlib-lm", prompt=prompts, max_tokens=24, temperature=0)
        assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == expected
        assert stop(leader, signal.SIGINT, timeout=120) == 0
        assert follower.wait(120) == 0
