"""Start-up refusals of a multi-process `jpaged serve`, before any JAX work: a follower that cannot
reach process 0 exits 2 naming the coordinator's address; processes whose engine flags differ are
both refused, naming the field; a bad --coordinator-address names the flag."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.helpers.server import free_port
from tests.parallel.serve_processes import PLAN_SECRET, distributed_args, start, stop


def _ended(process: subprocess.Popen, log: Path, timeout: float = 120.0) -> tuple[int, str]:
    try:
        process.wait(timeout)
    finally:
        stop(process)
    return process.returncode, log.read_text()


def test_unreachable_coordinator_is_an_error_naming_its_address(tmp_path):
    port = free_port()
    log, secret = tmp_path / "follower.log", tmp_path / "plan-secret"
    secret.write_text(PLAN_SECRET)
    code, text = _ended(start(log, *distributed_args(port, 1, "--join-timeout", "1", "--plan-secret-file", str(secret)),
                              plan_secret=None), log)
    assert code == 2, text
    assert f"--coordinator-address 127.0.0.1:{port}: cannot reach" in text and f"127.0.0.1:{port + 1}" in text


@pytest.mark.slow  # two interpreters importing jax: ~30 s on a busy 2-core machine (the channel's own test is fast)
def test_mismatched_configs_are_refused_on_both_sides_naming_the_field(tmp_path):
    """The follower exits at once; process 0 waits on for a follower with its config and names the
    refusal when --join-timeout ends."""
    port = free_port()
    logs = [tmp_path / f"process-{i}.log" for i in range(2)]
    follower = start(logs[1], *distributed_args(port, 1, "--join-timeout", "60"), "--max-num-seqs", "8")
    leader = start(logs[0], *distributed_args(port, 0, "--join-timeout", "10"), "--port", str(free_port()))
    for process, log in ((leader, logs[0]), (follower, logs[1])):
        code, text = _ended(process, log)
        assert code == 2, text
        assert "scheduler.max_num_seqs: process 0 has 16, this process has 8" in text, text


def test_a_coordinator_address_without_a_port_names_the_flag(tmp_path):
    log = tmp_path / "leader.log"
    args = distributed_args(0, 0)
    args[args.index("--coordinator-address") + 1] = "127.0.0.1"
    code, text = _ended(start(log, *args, "--port", str(free_port())), log)
    assert code == 2 and "--coordinator-address: must be host:port of process 0" in text, text
