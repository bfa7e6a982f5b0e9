"""Who may use the server: API keys, cross-origin access (CORS), TLS and the path prefix, as
`jpaged serve`'s flags give them (`Exposure.from_args`).

API keys (`--api-key`, repeatable, else $JPAGED_API_KEY): every request needs
`Authorization: Bearer <key>` except the routes a load balancer, a Prometheus scraper or a reader
of the API's schema call: /health, /metrics, /version and FastAPI's docs (/docs, /redoc,
/openapi.json). That is vLLM's public list (vllm/entrypoints/serve/middleware/authenticate.py,
where the guarded set is every route but PUBLIC_ENDPOINTS); vLLM releases before it guarded path
prefixes (/v1, ...) only, which left /tokenize, /detokenize and /tokenizer_info open. Here they are
guarded: they run the tokenizer on whatever text a caller sends. The guard fails closed: a path no
route serves gets 401 too (404 only with a key), so nothing is learnt about routes without one.

A refused request gets 401 with OpenAI's error object before any route runs: its body is never
read, and neither the tokenizer nor the engine sees it. Keys are compared as SHA-256 digests with
`hmac.compare_digest`, every key every time, so the time taken does not depend on how much of a
key matched. The path checked is the ASGI scope's own, minus the root path the way Starlette's
router takes it off (not `Request.url.path`, which Starlette rebuilds from the Host header:
vLLM's CVE-2026-48746).

CORS is off unless `--allowed-origins` is given (vLLM always allows every origin by default;
here a browser page on another origin gets no CORS headers, as before these flags). Its
middleware sits outside the key check, so preflight requests (OPTIONS, which browsers send
without credentials) are answered without a key, and a 401 carries the CORS headers a browser
needs to show it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import hmac
import os
import ssl
from collections.abc import Mapping, Sequence

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from jpaged.entrypoints.serve.errors import error_body
from jpaged.entrypoints.serve.limits import DEFAULT_MAX_REQUEST_BODY_BYTES

API_KEY_ENV = "JPAGED_API_KEY"
# Routes open without a key (vLLM's PUBLIC_ENDPOINTS, less those this server has no route for).
PUBLIC_PATHS = frozenset(("/health", "/metrics", "/version", "/docs", "/docs/oauth2-redirect", "/redoc",
                          "/openapi.json"))
# --ssl-cert-reqs takes ssl's numbers, as vLLM's flag does: what each means.
CERT_REQS = {int(ssl.CERT_NONE): "none", int(ssl.CERT_OPTIONAL): "optional", int(ssl.CERT_REQUIRED): "required"}


def route_path(scope: Scope) -> str:
    """The path Starlette's router matches: the scope's path less its root path (starlette's
    `get_route_path`, kept here because that one is private)."""
    path: str = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root) and (path == root or path[len(root)] == "/"):
        return path[len(root):]
    return path


class APIKeyAuth:
    """ASGI middleware: 401 for any request outside PUBLIC_PATHS without one of `keys` as its
    bearer token."""

    def __init__(self, app: ASGIApp, keys: Sequence[str]):
        if not keys or not all(keys):
            raise ValueError("api_keys: give at least one key, none of them empty")
        self.app = app
        self._digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    def _authorized(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        digest = hashlib.sha256(token.encode()).digest()
        matched = False
        for known in self._digests:  # no early exit: every key is compared every time
            matched |= hmac.compare_digest(digest, known)
        return matched and scheme.lower() == "bearer"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or route_path(scope) in PUBLIC_PATHS:
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        if self._authorized(headers):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":  # no such routes today; refused all the same (policy violation)
            await send({"type": "websocket.close", "code": 1008})
            return
        given = headers.get("authorization")
        message = ("no API key: send the header 'Authorization: Bearer <key>'" if given is None
                   else "the API key is not valid (expected 'Authorization: Bearer <key>' with one of the server's keys)")
        response = JSONResponse(error_body(message, None, "authentication_error", 401), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


@dataclasses.dataclass(frozen=True)
class CorsPolicy:
    """Starlette's CORSMiddleware settings (vLLM's --allowed-origins, --allow-credentials,
    --allowed-methods, --allowed-headers)."""

    allowed_origins: tuple[str, ...]
    allow_credentials: bool = False
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    def middleware_options(self) -> dict:
        """Keyword arguments of starlette.middleware.cors.CORSMiddleware."""
        return {"allow_origins": self.allowed_origins, "allow_credentials": self.allow_credentials,
                "allow_methods": self.allowed_methods, "allow_headers": self.allowed_headers}


@dataclasses.dataclass(frozen=True)
class Exposure:
    """How the server faces the network: keys, CORS, TLS, root path and load limits."""

    api_keys: tuple[str, ...] = ()
    cors: CorsPolicy | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    root_path: str = ""
    max_queued_requests: int | None = None  # None: no bound
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> Exposure:
        """The flags of `jpaged serve`, checked; ValueError naming the flag when one is wrong."""
        keys = tuple(args.api_keys) if args.api_keys else tuple(k for k in (environ.get(API_KEY_ENV),) if k)
        if not all(keys):
            raise ValueError("--api-key: a key must not be empty")
        for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                           ("--ssl-ca-certs", args.ssl_ca_certs)):
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{flag}: no such file: {path}")
        if (args.ssl_keyfile or args.ssl_ca_certs) and not args.ssl_certfile:
            raise ValueError("--ssl-certfile: required with --ssl-keyfile or --ssl-ca-certs (TLS needs a certificate)")
        if args.ssl_cert_reqs != int(ssl.CERT_NONE) and not args.ssl_ca_certs:
            raise ValueError(f"--ssl-ca-certs: required with --ssl-cert-reqs {args.ssl_cert_reqs} "
                             f"({CERT_REQS[args.ssl_cert_reqs]}): client certificates are checked against it")
        root = args.root_path or ""
        if root and (not root.startswith("/") or root.endswith("/")):
            raise ValueError(f"--root-path: must start with '/' and not end with one, like '/jpaged', got {root!r}")
        if args.max_queued_requests is not None and args.max_queued_requests < 1:
            raise ValueError(f"--max-queued-requests: must be >= 1, got {args.max_queued_requests}")
        body = args.max_request_body_bytes if args.max_request_body_bytes is not None else DEFAULT_MAX_REQUEST_BODY_BYTES
        if body < 1:
            raise ValueError(f"--max-request-body-bytes: must be >= 1, got {body}")
        cors = None
        if args.allowed_origins:
            cors = CorsPolicy(tuple(args.allowed_origins), args.allow_credentials, tuple(args.allowed_methods),
                              tuple(args.allowed_headers))
        return cls(keys, cors, args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs, root,
                   args.max_queued_requests, body)

    @property
    def scheme(self) -> str:
        """'https' when the server speaks TLS, else 'http'."""
        return "https" if self.ssl_certfile else "http"

    def uvicorn_options(self) -> dict:
        """Keyword arguments of uvicorn.Config: TLS and the root path."""
        return {"ssl_keyfile": self.ssl_keyfile, "ssl_certfile": self.ssl_certfile, "ssl_ca_certs": self.ssl_ca_certs,
                "ssl_cert_reqs": self.ssl_cert_reqs, "root_path": self.root_path}
