"""What the serving benchmarks share: a server process with its CPU time, `jpaged bench-serving`
runs, and the machine's load.

CPU time of a server is the sum of user + system time over its process tree (vLLM's API server
spawns an engine-core process), read from /proc: Linux only, as the benchmarks are.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from experiments.common import REPO_ROOT

_TICKS = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            kids += [int(k) for k in (task / "children").read_text().split()]
    return kids


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live descendants (threads included)."""
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
            stack += _children(p)
    return total


class ServerProcess:
    """A server started from `command`, up once GET base_url/health answers 200 (polled every
    `poll_s` seconds)."""

    def __init__(self, name: str, command: list[str], port: int, env: dict | None = None,
                 startup_timeout: float = 900.0, poll_s: float = 1.0):
        self.name, self.port = name, port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log")[1])
        with self.log.open("w") as log:
            self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, **(env or {})}, start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.process.returncode}; log: {self.log}")
            with contextlib.suppress(OSError):  # refused while starting; URLError is an OSError
                with urllib.request.urlopen(self.base_url + "/health", timeout=5) as response:
                    if response.status == 200:
                        return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{name} did not come up in {startup_timeout} s; log: {self.log}")
            time.sleep(poll_s)

    def cpu_seconds(self) -> float:
        """CPU seconds its process tree used so far."""
        return tree_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        """SIGTERM to its process group (the server and its children), then wait; SIGKILL after 60 s."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@contextlib.contextmanager
def serving(name: str, command: list[str], port: int, env: dict | None = None) -> Iterator[ServerProcess]:
    """A ServerProcess, stopped on exit."""
    server = ServerProcess(name, command, port, env)
    try:
        yield server
    finally:
        server.stop()


def bench_serving(server: ServerProcess, args: list[str]) -> dict:
    """One `jpaged bench-serving` run against `server` (a child process): its JSON report, plus the
    server's CPU seconds during the run, the run's wall time and the load average after it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        cpu_before, start = server.cpu_seconds(), time.perf_counter()
        subprocess.run([sys.executable, "-m", "jpaged.entrypoints.cli", "bench-serving", "--base-url", server.base_url,
                        "--output", str(out), *args], cwd=REPO_ROOT, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        report = json.loads(out.read_text())
    report["server_cpu_s"] = server.cpu_seconds() - cpu_before
    report["wall_s"] = wall
    report["load_average"] = os.getloadavg()
    return report
