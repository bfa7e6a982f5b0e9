"""The `jpaged` command: `jpaged serve` (the OpenAI-compatible server) and `jpaged bench-serving`.

Flags are declared here without importing the server, so `jpaged --help` works without the
`serve` extra; each subcommand imports what it runs. The engine flags are generated from the config
dataclasses (jpaged.entrypoints.engine_flags); the server's, the multi-process run's and the
exposure flags are written here.
"""

from __future__ import annotations

import argparse
import json
import sys

from jpaged.entrypoints.engine_flags import add_engine_flags


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI API (FastAPI + uvicorn)",
                       description="Serve a model with an OpenAI-compatible HTTP API: /v1/completions, "
                                   "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /tokenizer_info, "
                                   "/version, /health, /metrics. Each engine flag (the model, cache and scheduler "
                                   "groups) is a field of jpaged.config, by the same name also a keyword of "
                                   "LLM(...) and a key of that section of --config.")
    p.add_argument("--model", required=True, help="a preset name or a local Hugging Face directory")
    p.add_argument("--tokenizer", help="a local HF directory to take the tokenizer from (default: the model's)")
    p.add_argument("--config", help="engine YAML (model / cache / scheduler sections, as EngineConfig); "
                                    "the engine flags below override it")
    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=8000)
    server.add_argument("--served-model-name", help="the model id clients use (default: --model as given)")
    server.add_argument("--stream-interval", type=int, default=1,
                        help="streams send the first token at once, then every N engine steps (vLLM's knob; "
                             "1 = each)")
    server.add_argument("--warmup", choices=["grid", "smallest", "none"], default="grid",
                        help="what compiles before /health answers 200: every step shape and sampler program (grid; "
                             "compiled programs are cached under $JPAGED_CACHE_DIR, default ~/.cache/jpaged), the "
                             "smallest prefill and decode steps only, or nothing (the rest compiles on first use)")
    server.add_argument("--no-warmup", dest="warmup", action="store_const", const="none", help="--warmup none")
    server.add_argument("--shutdown-timeout", type=float, default=5.0,
                        help="on SIGTERM / SIGINT, seconds open requests get to finish before the rest are aborted")
    server.add_argument("--disable-access-log", action="store_true")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    engine = add_engine_flags(p)
    engine["cache"].add_argument("--pin-prefix", action="append", dest="pinned_prefixes", metavar="TEXT",
                                 help="pre-store this prompt prefix in the prefix cache, never evicted (repeatable; "
                                      "needs --enable-prefix-caching)")
    hosts = p.add_argument_group("multi-process serving (jpaged.entrypoints.multihost)",
                                 "process 0 serves HTTP and schedules; every other process runs the same command "
                                 "with its own --process-id, opens no port and executes process 0's steps")
    hosts.add_argument("--coordinator-address", help="host:port of process 0 for jax.distributed (required with "
                                                     "--num-processes > 1)")
    hosts.add_argument("--num-processes", type=int, default=1, help="processes in the run (1: this one alone)")
    hosts.add_argument("--process-id", type=int, default=0, help="this process's rank in [0, --num-processes)")
    hosts.add_argument("--plan-port", type=int,
                       help="port of process 0's plan channel (default: the coordinator's port + 1)")
    hosts.add_argument("--plan-secret-file", help="file holding the plan channel's shared secret, the same on every "
                                                  "process, at least 16 bytes (default: $JPAGED_PLAN_SECRET; required "
                                                  "with --num-processes > 1)")
    hosts.add_argument("--follower-timeout", type=float, default=60.0,
                       help="seconds a follower may stay silent or leave a step unfinished before process 0 "
                            "fails its requests and reports unhealthy")
    hosts.add_argument("--compile-timeout", type=float, default=600.0,
                       help="the same bound for a step of a shape not run before (it may compile)")
    hosts.add_argument("--join-timeout", type=float, default=300.0,
                       help="seconds to wait at start-up for every process to join")
    _exposure_flags(p)


def _json_list(text: str) -> tuple[str, ...]:
    """--allowed-origins and friends: a JSON list of strings (vLLM's form)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings such as '[\"https://app.example\"]', "
                                         f"got {text!r}")
    return tuple(value)


def _exposure_flags(p) -> None:
    """Flags for a server others reach (jpaged.entrypoints.serve.security and limits)."""
    net = p.add_argument_group("running it for others (keys, TLS, CORS, limits)")
    net.add_argument("--api-key", action="append", dest="api_keys", metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every route but /health, /metrics, /version "
                          "and the docs (repeatable: any of the keys; default: $JPAGED_API_KEY, else none)")
    net.add_argument("--ssl-keyfile", help="TLS private key file (uvicorn's)")
    net.add_argument("--ssl-certfile", help="TLS certificate file: the server speaks https (uvicorn's)")
    net.add_argument("--ssl-ca-certs", help="CA certificates that client certificates are checked against")
    net.add_argument("--ssl-cert-reqs", type=int, choices=[0, 1, 2], default=0,
                     help="client certificates: 0 not asked for, 1 optional, 2 required (ssl.CERT_*)")
    net.add_argument("--root-path", default="",
                     help="the path prefix a proxy in front strips (e.g. /jpaged): URLs and the docs carry it")
    net.add_argument("--allowed-origins", type=_json_list,
                     help="enable CORS for these origins, a JSON list such as '[\"https://app.example\"]' "
                          "(default: no CORS headers)")
    net.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    net.add_argument("--allowed-methods", type=_json_list, default=("*",), help="CORS: JSON list (default all)")
    net.add_argument("--allowed-headers", type=_json_list, default=("*",), help="CORS: JSON list (default all)")
    net.add_argument("--max-queued-requests", type=int,
                     help="refuse generation requests with 503 and Retry-After while this many wait for the engine "
                          "(counted in jpaged:requests_shed; default: no bound)")
    net.add_argument("--max-request-body-bytes", type=int,
                     help="413 for a larger request body, before it is parsed (default 16 MiB: a long prompt "
                          "several times over; jpaged.entrypoints.serve.limits)")


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench-serving", help="replay a Poisson trace against an OpenAI-compatible server",
                       description="Replay a ShareGPT- or Alpaca-shaped Poisson trace against a server's "
                                   "/v1/completions (streamed) and print vLLM benchmark_serving's metrics.")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--dataset", choices=["sharegpt", "alpaca"], default="sharegpt")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--length-scale", type=float, default=1.0, help="multiply the trace's lengths by this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", help="model id to send (default: the server's first /v1/models entry)")
    p.add_argument("--tokenizer", help="local HF dir giving the vocabulary (default: the model id as a path)")
    p.add_argument("--max-model-len", type=int, help="default: the server's /v1/models max_model_len")
    p.add_argument("--output", default="bench_serving.json", help="result JSON ('' to skip)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jpaged` console script."""
    parser = argparse.ArgumentParser(prog="jpaged", description="jpaged: PagedAttention in JAX, served.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{serve,bench-serving}")
    _serve_parser(sub)
    _bench_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "serve":
        from jpaged.entrypoints.serve.launch import run
    else:
        if args.num_prompts < 1 or not args.request_rate > 0 or not args.length_scale > 0:
            parser.error("--num-prompts must be >= 1, --request-rate and --length-scale > 0")
        from jpaged.entrypoints.bench_serving import run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
