"""The server under stress, on its own `jpaged serve` (prefix caching on, a 1 s drain): readiness
during warm-up, prefix-cache metrics, megabyte prompts beside live streams and /health, and a
SIGTERM drain with a client that never reads (the module's last test: it stops the server)."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.helpers.server import MODEL, metric, metrics, running_server

DRAIN_S = 1.0


def _post_during_warm_up(server) -> tuple[int, dict]:
    response = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2},
                          timeout=30)
    return response.status_code, response.json()


@pytest.fixture(scope="module")
def stress_server(tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("stress"), "--enable-prefix-caching", "--shutdown-timeout",
                        str(DRAIN_S), on_starting=_post_during_warm_up) as s:
        yield s


def test_health_is_503_until_the_warm_up_is_done(stress_server):
    seen = stress_server.health_while_starting
    assert 503 in seen and seen[-1] == 200 and seen.index(503) < seen.index(200)
    status, body = stress_server.starting_result  # a completion sent while /health said 503
    assert status == 503 and body["error"]["type"] == "service_unavailable" and "warming up" in body["error"]["message"]
    assert httpx.get(stress_server.base_url + "/health").status_code == 200


def test_prefix_cache_queries_and_hits_count_tokens_as_vllm(stress_server):
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 can be served from the cache
    before = metrics(stress_server.base_url)
    for _ in range(2):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        assert httpx.post(stress_server.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
    after = metrics(stress_server.base_url)
    queries = metric(after, "vllm:prefix_cache_queries_total") - metric(before, "vllm:prefix_cache_queries_total")
    hits = metric(after, "vllm:prefix_cache_hits_total") - metric(before, "vllm:prefix_cache_hits_total")
    assert (queries, hits) == (2 * 40, 32)  # each request queries its whole prompt; the second hits 2 blocks


def _stream_times(base_url: str, body: dict, out: dict) -> None:
    """Reads a stream into `out`: its events and when each came (filled as they come)."""
    times, events = out.setdefault("times", []), out.setdefault("events", [])
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                times.append(time.monotonic())
                events.append(line[6:])


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_megabyte_prompts_stall_neither_health_nor_other_streams(stress_server):
    url = stress_server.base_url
    body = {"model": MODEL, "prompt": "import os", "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    alone: dict = {}
    _stream_times(url, body, alone)  # also compiles the steps this stream needs: no compile below
    streamed: dict = {}
    stream = threading.Thread(target=_stream_times, args=(url, body, streamed))
    probes: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            start = time.monotonic()
            assert httpx.get(url + "/health", timeout=60).status_code == 200
            probes.append(time.monotonic() - start)
            time.sleep(0.05)

    prober = threading.Thread(target=probe)
    stream.start()
    prober.start()
    big = ("def f(x):\n    return x  # é, ü\n" * 40_000)[:1_000_000]  # 1 MB of text, about 0.5 M tokens
    start = time.monotonic()
    response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [big] * 4, "max_tokens": 1},
                          timeout=300)
    elapsed = time.monotonic() - start
    done.set()
    prober.join(60)
    stream.join(300)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"  # far too long
    gaps = [b - a for a, b in zip(streamed["times"], streamed["times"][1:])]
    alone_gaps = [b - a for a, b in zip(alone["times"], alone["times"][1:])]
    print(f"4 x 1 MB prompts refused after {elapsed:.1f} s; /health: {len(probes)} probes, slowest "
          f"{max(probes):.2f} s; the stream's longest gap {max(gaps):.2f} s ({max(alone_gaps):.2f} s alone)")
    # Tokenized on the event loop these stalled everything for the whole tokenization (4 s on the
    # issue's machine, tens of seconds on 2 busy cores); in a worker thread, without the GIL, a
    # probe answers at once. The bound is generous: it only tells a stall from a busy machine.
    assert len(probes) >= 3 and max(probes) < 5.0
    assert streamed["events"][-1] == "[DONE]" and max(gaps) < 5.0


def _never_reading_client(url: str, body: dict) -> socket.socket:
    """A raw HTTP client that sends a streaming request and never reads the answer (a tiny receive
    buffer, so the server's writes block as soon as the kernel's buffers fill)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


def test_sigterm_drains_then_aborts_frees_blocks_and_exits_0(stress_server):
    url = stress_server.base_url
    short, long = {}, {}
    common = {"model": MODEL, "temperature": 0, "stream": True, "ignore_eos": True}
    # Big chunks (4 samples x 20 log-probabilities per token) fill any socket buffer quickly.
    stuck = _never_reading_client(url, {**common, "prompt": "def f(x):", "max_tokens": 480, "n": 4, "logprobs": 20,
                                        "temperature": 1.0})
    # `long` outlasts the 1 s drain: 480 tokens took 3-4 s here beside the others (with a 3 s drain
    # it ended inside it on an idle machine). The never-reading client's request is as long, but it
    # is not observed, so the count of open requests at the deadline may be 1 or 2.
    readers = [threading.Thread(target=_stream_times, args=(url, {**common, "prompt": "class A:", "max_tokens": 480},
                                                            long)),
               threading.Thread(target=_stream_times, args=(url, {**common, "prompt": "import os", "max_tokens": 12},
                                                            short))]
    readers[0].start()
    _wait_for(lambda: metric(metrics(url), "vllm:num_requests_running") >= 2 and long.get("events"))
    readers[1].start()
    _wait_for(lambda: short.get("events"))  # all three are being served
    start = time.monotonic()
    status = stress_server.stop(signal.SIGTERM, timeout=60)
    took = time.monotonic() - start
    for reader in readers:
        reader.join(60)
    stuck.close()
    log = stress_server.log()
    assert status == 0, log
    # The drain waited its 1 s for the long requests, aborted them, cut off the client that never
    # reads 2 s later, and stopped: well within a generous bound (the issue: it never stopped).
    assert DRAIN_S <= took < 30, (took, log)
    assert json.loads(short["events"][-2])["choices"][0]["finish_reason"] == "length"
    assert json.loads(long["events"][-2])["choices"][0]["finish_reason"] == "abort"
    assert short["events"][-1] == long["events"][-1] == "[DONE]"
    # The drain aborts them at its deadline; on a loaded machine uvicorn's own graceful timeout (the
    # deadline plus a grace) can end first, and the app's shutdown aborts them instead (seen once in
    # a full suite run): either way the open requests end with "abort" (`long`'s checked above).
    assert re.search(rf"shutdown: [12] request\(s\) (still open after {DRAIN_S} s: aborted|aborted at exit)", log), log
    assert "KV blocks in use: 0 of 255" in log
