"""The echo comparison's own logic (no servers): what counts as a difference, and the lm-eval items."""

import pytest

pytest.importorskip("httpx", reason="httpx is not installed: pip install -e \".[test]\"")

from experiments.peers.echo_vs_vllm import EchoVsVllmConfig, comparable, differences, mc_items


def test_differences_tolerates_float_noise_and_names_the_rest():
    a = {"choices": [{"text": "x", "logprobs": {"token_logprobs": [None, -1.0]}}], "usage": {"prompt_tokens": 2}}
    close = {"choices": [{"text": "x", "logprobs": {"token_logprobs": [None, -1.000004]}}],
             "usage": {"prompt_tokens": 2}, "prompt_logprobs": None}
    assert differences(a, close, 1e-5) == []  # a key vLLM sends as null is no difference
    far = {"choices": [{"text": "y", "logprobs": {"token_logprobs": [None, -1.1]}}], "usage": {"prompt_tokens": 3},
           "extra_field": [1]}
    found = differences(a, far, 1e-5)
    assert any(d.startswith(".choices[0].text") for d in found)
    assert any(d.startswith(".choices[0].logprobs.token_logprobs[1]") for d in found)
    assert any(d.startswith(".usage.prompt_tokens") for d in found)
    assert any(d.startswith(".extra_field: missing") for d in found)
    assert differences([1, 2], [1], 0.0) == [": length 2 vs 1"]


def test_comparable_drops_ids_at_any_depth():
    answer = {"id": "cmpl-1", "created": 5, "choices": [{"index": 0, "token_ids": [1], "text": "a"}]}
    assert comparable(answer) == {"choices": [{"index": 0, "text": "a"}]}


def test_mc_items_are_seeded_lines_split_in_two():
    config = EchoVsVllmConfig(num_items=5, num_choices=3)
    items = mc_items(config)
    assert items == mc_items(config) and len(items) == 5
    for item in items:
        assert item["answer"] == 0 and len(item["choices"]) == 3
        assert len(item["context"]) + len(item["choices"][0]) >= 30
