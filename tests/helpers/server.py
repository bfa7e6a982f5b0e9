"""A real `jpaged serve` in a subprocess on 127.0.0.1 with a free port (http, or https with a
certificate the client trusts), and a /metrics reader."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import ssl
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx

from tests.helpers.text_assets import ASSET

REPO = Path(__file__).resolve().parents[2]
MODEL = "stdlib-lm"  # the served model id
# A small pool and budgets: the asset model is tiny, and the tests want blocks to be countable.
# (`--warmup smallest`: the full grid is tests/executors/test_warmup.py's, and too slow for every session)
SERVE_ARGS = ["--num-blocks", "256", "--block-size", "16", "--max-num-seqs", "32", "--attention-backend", "xla",
              "--warmup", "smallest"]


def free_port() -> int:
    """A TCP port nobody listens on now (the server binds it right after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running server process: its base URL, what /health said while it started, and how it ended."""

    def __init__(self, process: subprocess.Popen, port: int, log_path: Path, verify: ssl.SSLContext | None = None):
        """`verify`: the TLS context trusting the server's certificate (None: plain http)."""
        self.process, self.port, self.log_path, self.verify = process, port, log_path, verify
        self.base_url = f"{'https' if verify else 'http'}://127.0.0.1:{port}"
        self.health_while_starting: list[int] = []  # /health's status codes until the first 200
        self.starting_result: Any = None  # what `on_starting` returned

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        """Sends `sig` and waits; the exit status (the process is killed if it does not exit)."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(tmp_path: Path, *extra: str, env: Mapping[str, str] | None = None,
                 verify: ssl.SSLContext | None = None) -> Server:
    """Starts `python -m jpaged.entrypoints.cli serve --model assets/stdlib-lm` (SERVE_ARGS, then
    `extra`) on a free port, its output logged under `tmp_path`, on the CPU, with `env` added to
    this process's environment (`verify`: see `running_server`); returns at once."""
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    command = [sys.executable, "-m", "jpaged.entrypoints.cli", "serve", "--model", str(ASSET), "--served-model-name", MODEL,
               "--port", str(port), *SERVE_ARGS, *extra]
    with log_path.open("w") as log:
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
    return Server(process, port, log_path, verify)


@contextlib.contextmanager
def running_server(tmp_path: Path, *extra: str, timeout: float = 240.0,
                   on_starting: Callable[[Server], Any] | None = None, env: Mapping[str, str] | None = None,
                   verify: ssl.SSLContext | None = None) -> Iterator[Server]:
    """`python -m jpaged.entrypoints.cli serve --model assets/stdlib-lm` until /health answers 200; stopped after.

    `on_starting(server)` runs once, as soon as /health first answers 503 (the server listens
    but is warming up); its result is kept as `server.starting_result`. `env`: added to the
    process's environment; `verify`: for a server started with TLS flags, a context trusting its
    certificate (the URLs are then https).
    """
    server = start_server(tmp_path, *extra, env=env, verify=verify)
    process = server.process
    try:
        deadline = time.monotonic() + timeout
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}:\n{server.log()}")
            with contextlib.suppress(httpx.HTTPError):
                status = httpx.get(server.base_url + "/health", timeout=5, verify=verify or True).status_code
                server.health_while_starting.append(status)
                if status == 200:
                    break
                if status == 503 and on_starting is not None and server.health_while_starting.count(503) == 1:
                    server.starting_result = on_starting(server)
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up in {timeout} s:\n{server.log()}")
            time.sleep(0.02)
        yield server
    finally:
        server.stop()


def metrics(base_url: str) -> dict[str, float]:
    """GET /metrics as {'name{labels}': value} (labels as printed), comments dropped."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            values[key] = float(value)
    return values


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """The value of `name` whose labels include `labels` (0.0 when absent, as for an unseen counter)."""
    for key, value in values.items():
        if (key == name or key.startswith(name + "{")) and all(f'{k}="{v}"' in key for k, v in labels.items()):
            return value
    return 0.0
