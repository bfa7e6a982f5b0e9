"""`jpaged serve` as one process or as process 0 + a follower on loopback, for the multi-process tests.

By default tiny-llama (no tokenizer: prompts are token ids) on a 12-block pool with swap
preemption; a multi-process run gives each process 2 virtual CPU devices and splits the model over
all 4.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from jpaged.executors.plan_link import SECRET_ENV
from tests.helpers.server import free_port

REPO = Path(__file__).resolve().parents[2]
ENGINE_ARGS = ["--model", "tiny-llama", "--attention-backend", "xla", "--block-size", "8", "--num-blocks", "13",
               "--num-host-blocks", "64", "--max-model-len", "128", "--max-num-seqs", "16",
               "--preemption-mode", "swap"]
PLAN_SECRET = "the plan channel's secret in the serve tests"


def start(log_path: Path, *args: str, devices: int = 1, engine_args: list[str] = ENGINE_ARGS,
          plan_secret: str | None = PLAN_SECRET) -> subprocess.Popen:
    """`python -m jpaged.entrypoints.cli serve engine_args args` with `devices` virtual CPU devices
    and `plan_secret` in $JPAGED_PLAN_SECRET (None: unset)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    env.pop(SECRET_ENV, None)
    if plan_secret is not None:
        env[SECRET_ENV] = plan_secret
    with log_path.open("w") as log:
        return subprocess.Popen([sys.executable, "-m", "jpaged.entrypoints.cli", "serve", *engine_args, *args],
                                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)


def distributed_args(coordinator_port: int, process_id: int, *extra: str, tp: int = 4) -> list[str]:
    """The multi-process flags of process `process_id` of 2 (tensor parallelism over `tp` devices)."""
    return ["--tensor-parallel-size", str(tp), "--coordinator-address", f"127.0.0.1:{coordinator_port}",
            "--num-processes", "2", "--process-id", str(process_id), *extra]


def wait_healthy(process: subprocess.Popen, base_url: str, log_path: Path, timeout: float = 400.0) -> None:
    """Until /health answers 200; RuntimeError with the log if the process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{log_path.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base_url + "/health", timeout=5).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not come up in {timeout} s:\n{log_path.read_text()[-4000:]}")
        time.sleep(0.5)


def stop(process: subprocess.Popen, sig: int = signal.SIGKILL, timeout: float = 60.0) -> int:
    """Sends `sig` (the process is killed if it does not exit within `timeout`); its exit status."""
    if process.poll() is None:
        process.send_signal(sig)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode


@contextlib.contextmanager
def single(tmp_path: Path) -> Iterator[str]:
    """One process (one device, no tensor parallelism): yields its base URL."""
    port = free_port()
    log = tmp_path / "single.log"
    process = start(log, "--port", str(port))
    try:
        wait_healthy(process, f"http://127.0.0.1:{port}", log)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process, signal.SIGINT)


@contextlib.contextmanager
def two_processes(tmp_path: Path, *extra: str, devices: int = 2, engine_args: list[str] = ENGINE_ARGS
                  ) -> Iterator[tuple[str, subprocess.Popen, subprocess.Popen]]:
    """Process 0 (HTTP) and a follower with `devices` devices each, the model split over all of them:
    yields (process 0's base URL, process 0, the follower). Both are killed after (unless they
    exited): a process 0 whose follower died may never leave its stuck step."""
    coordinator, port = free_port(), free_port()
    logs = [tmp_path / f"process-{i}.log" for i in range(2)]
    follower = start(logs[1], *distributed_args(coordinator, 1, *extra, tp=2 * devices), devices=devices,
                     engine_args=engine_args)
    leader = start(logs[0], *distributed_args(coordinator, 0, *extra, tp=2 * devices), "--port", str(port),
                   devices=devices, engine_args=engine_args)
    try:
        wait_healthy(leader, f"http://127.0.0.1:{port}", logs[0])
        yield f"http://127.0.0.1:{port}", leader, follower
    finally:
        for process in (leader, follower):
            stop(process)
