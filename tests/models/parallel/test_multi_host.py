"""Two processes on localhost, 2 virtual CPU devices each, serve with tensor_parallel_size 4 over
the 4 devices of both (jax.distributed wired from the config, gloo collectives on CPU): both
produce the single-device greedy outputs, through a swap preemption."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.parallel.multihost_worker import DEVICES_FLAG, config, serve

ROOT = Path(__file__).resolve().parents[3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_serve_like_one_device():
    expected = serve(config(1))
    assert expected["preemptions"] > 0
    port = _free_port()
    env = os.environ | {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": DEVICES_FLAG}
    workers = [subprocess.Popen([sys.executable, "-m", "tests.models.parallel.multihost_worker", str(i), str(port)],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
    results = [w.communicate(timeout=300) for w in workers]
    failed = [f"process {i} exited {w.returncode}:\n{err[-3000:]}" for i, (w, (_, err)) in enumerate(zip(workers, results))
              if w.returncode != 0]
    assert not failed, "\n".join(failed)  # (every process's error: the first to fail explains the others)
    for out, _ in results:
        assert json.loads(out.strip().splitlines()[-1]) == expected
