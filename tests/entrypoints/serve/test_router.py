"""Two `jpaged serve` replicas behind sglang-router (an existing router from PyPI), on loopback.

The router's cache-aware policy keeps a radix tree of the requests it has routed and sends a
request to the replica that served its longest prefix: requests sharing a long prefix meet on one
replica, whose prefix cache then serves them (`vllm:prefix_cache_hits` on that replica's /metrics,
none on the other's). When a replica dies, its streams end with an error and new requests reach
the survivor. Slow tier (three processes, a few minutes on 2 cores); skipped without sglang-router.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers.server import MODEL, Server, free_port, metric, metrics, running_server

pytestmark = pytest.mark.slow
pytest.importorskip("sglang_router", reason="needs sglang-router (pip install -e '.[router]')")

# Two families of prompts, each a long shared prefix (several 16-token blocks) and a short tail.
PREFIXES = {
    "a": "import os\nimport sys\n\n\ndef read_config(path):\n    with open(path) as handle:\n        return handle.read()\n",
    "b": "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n",
}


@contextlib.contextmanager
def router(workers: list[Server]) -> Iterator[str]:
    """sglang-router on a free port with the cache-aware policy over `workers`; yields its base URL."""
    port, prometheus = free_port(), free_port()
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
               "--worker-urls", *[w.base_url for w in workers], "--policy", "cache_aware",
               "--prometheus-port", str(prometheus), "--health-check-interval-secs", "1",
               "--health-failure-threshold", "1", "--log-level", "warn"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert process.poll() is None and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.2)
        yield base_url
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def complete(base_url: str, prompt: str, **fields) -> httpx.Response:
    return httpx.post(base_url + "/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **fields})


def hits(server: Server) -> float:
    return metric(metrics(server.base_url), "vllm:prefix_cache_hits_total")


@pytest.fixture(scope="module")
def replicas(tmp_path_factory) -> Iterator[list[Server]]:
    tmp = tmp_path_factory.mktemp("replicas")
    with running_server(tmp, "--enable-prefix-caching") as one, running_server(tmp, "--enable-prefix-caching") as two:
        yield [one, two]


def test_shared_prefixes_concentrate_where_the_router_sends_them(replicas):
    with router(replicas) as url:
        for turn in range(4):
            for name, prefix in PREFIXES.items():
                response = complete(url, f"{prefix}# {name} {turn}\n")
                assert response.status_code == 200, response.text
    routed = [hits(r) for r in replicas]
    # Each family's first request misses; the next three meet its prefix on the replica that served
    # the first, whose cache serves them.
    assert sum(routed) > 0, routed
    # Each family is cached on exactly one replica: probed directly, one replica hits, the other misses.
    for name, prefix in PREFIXES.items():
        holders = []
        for replica in replicas:
            before = hits(replica)
            assert complete(replica.base_url, f"{prefix}# probe {name}\n").status_code == 200
            holders.append(hits(replica) > before)
        assert holders.count(True) == 1, (name, holders)


def stream_outcome(events: Iterator[str]) -> str:
    """'done' if a streamed completion ran to `[DONE]` with no error event, else 'failed'.

    Events are parsed, not searched: generated code may well contain the word "error".
    """
    try:
        payloads = [line.removeprefix("data:").strip() for line in events if line.startswith("data:")]
    except httpx.HTTPError:
        return "failed"  # the connection dropped: the client sees the failure
    if not payloads or payloads[-1] != "[DONE]":
        return "failed"
    return "failed" if any("error" in json.loads(p) for p in payloads[:-1]) else "done"


def test_a_dead_replica_fails_its_streams_and_the_survivor_serves(replicas, tmp_path):
    survivor = replicas[0]
    with running_server(tmp_path, "--enable-prefix-caching") as doomed, router([survivor, doomed]) as url:
        streams = []
        with httpx.Client(timeout=120) as client:
            for prefix in PREFIXES.values():
                request = client.build_request("POST", url + "/v1/completions", json={
                    "model": MODEL, "prompt": prefix, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
                    "stream": True})
                streams.append(client.send(request, stream=True))
            lines = [s.iter_lines() for s in streams]
            first = [next(it) for it in lines]  # both streams have started
            assert all(line.startswith("data:") for line in first), first
            # Where the router placed them (it usually spreads the two prefixes, but need not).
            on_survivor = int(metric(metrics(survivor.base_url), "vllm:num_requests_running"))
            os.kill(doomed.process.pid, signal.SIGKILL)
            outcomes = []
            for s, it in zip(streams, lines, strict=True):
                with contextlib.closing(s):
                    outcomes.append(stream_outcome(it))
        # Every stream ended (none hangs): those on the dead replica failed, those on the survivor finished.
        assert sorted(outcomes) == sorted(["done"] * on_survivor + ["failed"] * (2 - on_survivor)), \
            (outcomes, on_survivor)
        time.sleep(3)  # the router's health check (every second) marks the dead replica down
        for turn in range(3):
            response = complete(url, f"print({turn})\n")
            assert response.status_code == 200, response.text
