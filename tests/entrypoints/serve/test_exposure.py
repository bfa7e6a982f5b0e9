"""A server others reach, in process (the app over httpx's ASGI transport, an engine on the
simulator's executor, whose steps take their modeled wall time, and the asset's tokenizer): API
keys on every route but /health, /metrics, /version and the docs, refused before the tokenizer or
the engine sees anything; CORS; the body's bound (413 before parsing, declared or chunked); the
queue's bound under a burst (503 with Retry-After, counted; every admitted request completes);
the flags' checks."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx
import pytest

from jpaged.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from jpaged.config.presets import get_preset
from jpaged.engine import EngineObserver, LLMEngine
from jpaged.entrypoints import cli
from jpaged.entrypoints.async_engine import AsyncLLMEngine
from jpaged.entrypoints.serve.app import build_app
from jpaged.entrypoints.serve.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from jpaged.entrypoints.serve.security import CorsPolicy, Exposure
from jpaged.entrypoints.serve.state import ServerState
from jpaged.paper.sim.executor import SimExecutor
from jpaged.text.tokenizer import Tokenizer
from tests.helpers.text_assets import ASSET

KEYS = ("key-one", "key-two")
COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 4}
# Every route, with a request that succeeds (200) given a key. Guarded unless in OPEN.
ROUTES = [("GET", "/v1/models", None), ("POST", "/v1/completions", COMPLETION),
          ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
          ("POST", "/tokenize", {"prompt": "import os"}), ("POST", "/detokenize", {"tokens": [5, 6]}),
          ("GET", "/tokenizer_info", None), ("GET", "/health", None), ("GET", "/metrics", None),
          ("GET", "/version", None), ("GET", "/openapi.json", None), ("GET", "/docs", None), ("GET", "/redoc", None)]
OPEN = {"/health", "/metrics", "/version", "/openapi.json", "/docs", "/redoc"}


class CountingTokenizer:
    """The tokenizer, counting every use of it."""

    def __init__(self, inner: Tokenizer):
        self.inner, self.uses = inner, 0

    def __getattr__(self, name):
        self.uses += 1
        return getattr(self.inner, name)


class MaxWaiting(EngineObserver):
    """The longest the scheduler's waiting queue was at the end of a step."""

    def __init__(self):
        self.longest = 0

    def on_step_end(self, engine, out, outputs, end):
        self.longest = max(self.longest, len(engine.scheduler.waiting))


def sim_engine(max_num_seqs: int = 8) -> AsyncLLMEngine:
    config = EngineConfig(model=ModelConfig(name="tiny-opt"), executor="sim",
                          cache=CacheConfig(block_size=16, num_blocks=128, num_host_blocks=0),
                          scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                                                    max_model_len=256))
    executor = SimExecutor(get_preset("opt-13b"), timed=True)  # ~25 ms a step, in wall time
    return AsyncLLMEngine(LLMEngine(config, executor=executor), CountingTokenizer(Tokenizer.from_dir(ASSET)))


def serve(engine: AsyncLLMEngine, exposure: Exposure, body, root_path: str = ""):
    """Runs `body(client)` against the app (its lifespan started) over `engine`; its result."""
    app = build_app(engine, "m", ServerState(engine, warm_up=None), exposure=exposure)

    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app, root_path=root_path)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
                return await body(client)

    return asyncio.run(main())


def count_engine_requests(engine: AsyncLLMEngine) -> list[str]:
    """Every request id that reaches AsyncLLMEngine.add_request, from now on."""
    seen, add = [], engine.add_request

    async def counted(request_id, *args, **kwargs):
        seen.append(request_id)
        return await add(request_id, *args, **kwargs)

    engine.add_request = counted
    return seen


async def call(client, method, path, body=None, **kw):
    return await client.request(method, path, json=body, **kw)


def assert_openai_error(response: httpx.Response, status: int, kind: str) -> None:
    assert response.status_code == status, (response.status_code, response.text)
    error = response.json()["error"]
    assert error["type"] == kind and error["code"] == status and error["message"] and "param" in error


def test_every_route_but_health_metrics_version_and_docs_needs_a_key():
    engine = sim_engine()
    tokenizer = engine.tokenizer
    reached = count_engine_requests(engine)

    async def body(client):
        tokenizer.uses = 0
        for method, path, payload in ROUTES:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEYS[0]}"},
                            {"Authorization": f"Bearer {KEYS[0]}x"}, {"Authorization": "Bearer"}):
                response = await call(client, method, path, payload, headers=headers)
                if path in OPEN:
                    assert response.status_code == 200, (path, response.text)
                    continue
                assert_openai_error(response, 401, "authentication_error")
                assert response.headers["www-authenticate"] == "Bearer"
                assert ("no API key" in response.json()["error"]["message"]) == (not headers)
        # Nothing refused reached the tokenizer or the engine.
        assert tokenizer.uses == 0 and reached == []
        # A path no route serves is refused too without a key (nothing is learnt about routes).
        assert (await client.get("/nope")).status_code == 401
        assert (await client.get("/nope", headers={"Authorization": f"Bearer {KEYS[0]}"})).status_code == 404
        for key in KEYS:  # any of the keys (repeatable --api-key)
            for method, path, payload in ROUTES:
                response = await call(client, method, path, payload, headers={"Authorization": f"Bearer {key}"})
                assert response.status_code == 200, (path, response.text)
        assert len(reached) == 2 * 2  # the completion and the chat, once per key

    serve(engine, Exposure(api_keys=KEYS), body)


def test_keys_behind_a_root_path():
    engine = sim_engine()

    async def body(client):
        assert (await client.get("/api/health")).status_code == 200
        assert (await client.get("/api/v1/models")).status_code == 401
        assert (await client.get("/api/tokenizer_info")).status_code == 401
        ok = await client.get("/api/v1/models", headers={"Authorization": f"Bearer {KEYS[1]}"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "m"

    serve(engine, Exposure(api_keys=KEYS, root_path="/api"), body, root_path="/api")


def test_cors_only_when_asked_for_and_preflights_need_no_key():
    origin = "https://app.example"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}

    async def with_cors(client):
        answer = await client.options("/v1/completions", headers=preflight)
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == origin
        other = await client.options("/v1/completions", headers={**preflight, "Origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        refused = await client.get("/v1/models", headers={"Origin": origin})  # the browser can read the 401
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == origin
        ok = await client.get("/v1/models", headers={"Origin": origin, "Authorization": f"Bearer {KEYS[0]}"})
        assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == origin

    serve(sim_engine(), Exposure(api_keys=KEYS, cors=CorsPolicy((origin,))), with_cors)

    async def without_cors(client):
        response = await client.get("/v1/models", headers={"Origin": origin})
        assert response.status_code == 200 and "access-control-allow-origin" not in response.headers

    serve(sim_engine(), Exposure(), without_cors)


def test_a_body_past_the_bound_is_refused_before_it_is_parsed():
    limit = 1000
    engine = sim_engine()
    tokenizer = engine.tokenizer
    reached = count_engine_requests(engine)
    pulled = []

    async def chunks(n: int, size: int):
        for i in range(n):
            pulled.append(i)
            yield b"x" * size

    async def body(client):
        tokenizer.uses = 0
        # Declared too large: 413 before a byte is read (the body's iterator is never pulled).
        declared = await client.post("/v1/completions", content=chunks(3, 600),
                                     headers={"Content-Length": "1800", "Content-Type": "application/json"})
        assert_openai_error(declared, 413, "invalid_request_error")
        assert "1000 bytes" in declared.json()["error"]["message"] and pulled == []
        # Chunked, no length: 413 once what was read passes the bound (the third chunk is never pulled).
        streamed = await client.post("/tokenize", content=chunks(3, 600), headers={"Content-Type": "application/json"})
        assert_openai_error(streamed, 413, "invalid_request_error")
        assert pulled == [0, 1]
        assert tokenizer.uses == 0 and reached == []
        # At the bound: served as usual.
        padded = {**COMPLETION, "user": ""}
        padded["user"] = "u" * (limit - len(json.dumps(padded).encode()))
        exact = await client.post("/v1/completions", content=json.dumps(padded).encode(),
                                  headers={"Content-Type": "application/json"})
        assert exact.status_code == 200, exact.text
        assert len(reached) == 1

    serve(engine, Exposure(max_request_body_bytes=limit), body)


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_the_queue_bound_sheds_a_burst_and_serves_everything_it_admitted():
    max_queued, burst, max_tokens = 3, 24, 12
    engine = sim_engine(max_num_seqs=2)  # two run at a time: the rest wait
    waiting = MaxWaiting()
    engine.engine.observers.append(waiting)

    async def body(client):
        responses = await asyncio.gather(*(client.post("/v1/completions", json={**COMPLETION, "max_tokens": max_tokens})
                                           for _ in range(burst)))
        shed = [r for r in responses if r.status_code == 503]
        served = [r for r in responses if r.status_code == 200]
        assert len(shed) + len(served) == burst, [r.text for r in responses]
        assert shed and len(served) >= max_queued
        for r in shed:
            assert_openai_error(r, 503, "service_unavailable")
            assert r.headers["retry-after"] == "1" and "--max-queued-requests" in r.json()["error"]["message"]
        for r in served:  # everything admitted ran to its end
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == max_tokens
        text = (await client.get("/metrics")).text
        assert _metric(text, "jpaged:requests_shed_total") == len(shed)
        assert engine.num_open_requests == 0
        after = await client.post("/v1/completions", json=COMPLETION)  # the queue drained: admitted again
        assert after.status_code == 200

    serve(engine, Exposure(max_queued_requests=max_queued), body)
    assert 0 < waiting.longest <= max_queued
    stats = engine.engine.kv_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_without_a_queue_bound_nothing_is_shed():
    async def body(client):
        responses = await asyncio.gather(*(client.post("/v1/completions", json=COMPLETION) for _ in range(12)))
        assert [r.status_code for r in responses] == [200] * 12
        assert _metric((await client.get("/metrics")).text, "jpaged:requests_shed_total") == 0

    serve(sim_engine(max_num_seqs=2), Exposure(), body)


def serve_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli._serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", "--model", "m", *flags])


def test_flags_become_an_exposure_or_a_clear_error(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("not read here")
    default = Exposure.from_args(serve_args(), environ={})
    assert default == Exposure() and default.max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES
    assert Exposure.from_args(serve_args(), environ={"JPAGED_API_KEY": "env-key"}).api_keys == ("env-key",)
    assert Exposure.from_args(serve_args(), environ={"JPAGED_API_KEY": ""}).api_keys == ()
    flags = Exposure.from_args(serve_args("--api-key", "a", "--api-key", "b", "--allowed-origins", '["https://x"]',
                                          "--ssl-certfile", str(cert), "--root-path", "/p",
                                          "--max-queued-requests", "5", "--max-request-body-bytes", "100"),
                               environ={"JPAGED_API_KEY": "env-key"})
    assert flags.api_keys == ("a", "b")  # the flag's keys replace the environment's (as vLLM's)
    assert flags.cors == CorsPolicy(("https://x",)) and flags.scheme == "https"
    assert flags.uvicorn_options()["root_path"] == "/p" and flags.uvicorn_options()["ssl_certfile"] == str(cert)
    assert (flags.max_queued_requests, flags.max_request_body_bytes) == (5, 100)
    for bad, message in ((["--api-key", ""], "--api-key: a key must not be empty"),
                         (["--ssl-keyfile", str(cert)], "--ssl-certfile: required"),
                         (["--ssl-certfile", str(tmp_path / "absent.pem")], "--ssl-certfile: no such file"),
                         (["--ssl-certfile", str(cert), "--ssl-cert-reqs", "2"], "--ssl-ca-certs: required"),
                         (["--root-path", "api"], "--root-path: must start with '/'"),
                         (["--max-queued-requests", "0"], "--max-queued-requests: must be >= 1, got 0"),
                         (["--max-request-body-bytes", "0"], "--max-request-body-bytes: must be >= 1, got 0")):
        with pytest.raises(ValueError, match=message):
            Exposure.from_args(serve_args(*bad), environ={})
    with pytest.raises(SystemExit):
        serve_args("--allowed-origins", "https://x")  # not a JSON list


def test_serve_refuses_bad_exposure_flags_before_building_the_engine(capsys):
    assert cli.main(["serve", "--model", "no-such-model", "--max-queued-requests", "-1"]) == 2
    assert "--max-queued-requests: must be >= 1" in capsys.readouterr().err
