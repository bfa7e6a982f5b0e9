"""The plan channel on loopback, without JAX: plans arrive in order and stop ends them; a config that
differs is refused on both sides with its field; an unreachable coordinator is an error naming its
address; a follower that dies, reports an error (the callbacks hear it), hangs in a step or goes silent is reported lost
within the timeout, and every later send raises."""

import socket
import threading
import time

import pytest

from jpaged.executors.plan_channel import FollowerLost, PlanClient, PlanServer, config_mismatch
from tests.parallel.channel_pair import SECRET, free_port, joined_pair

CONFIG = {"model": {"name": "tiny-llama", "process_id": 0, "num_processes": 2}, "cache": {"num_blocks": 13}}


def _connect(port: int, within: float = 10.0) -> socket.socket:
    """A connection to 127.0.0.1:port, retried until the server listens (it binds after the joiner starts)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=within)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _port() -> int:
    return free_port()


def _follower_config(**cache) -> dict:
    return {"model": {**CONFIG["model"], "process_id": 1}, "cache": {**CONFIG["cache"], **cache}}


def _pair(timeout=1.0, config=None, compile_timeout=None):
    return joined_pair(CONFIG, config or _follower_config(), timeout, compile_timeout)


def _lost_within(server: PlanServer, seconds: float) -> float:
    """Seconds until the server reported a loss (fails the test past `seconds`)."""
    start = time.monotonic()
    while server.error is None:
        assert time.monotonic() - start < seconds, "no loss reported"
        time.sleep(0.01)
    return time.monotonic() - start


def test_plans_arrive_in_order_and_stop_ends_them():
    server, client = _pair()
    sent = [[b"step", str(i).encode() * i] for i in range(1, 6)]
    for buffers in sent:
        server.send_plan(buffers)
    server.close()
    got = [bytes(p) for p in client.plans()]
    assert got == [b"".join(b) for b in sent]
    client.close()


def test_config_mismatch_names_the_field_on_both_sides():
    assert config_mismatch(CONFIG, _follower_config()) is None  # process_id is the one field that may differ
    port, box = _port(), {}

    def join():
        with pytest.raises(ValueError) as info:
            PlanClient("127.0.0.1", port, 1, _follower_config(num_blocks=14), secret=SECRET, join_timeout=10)
        box["follower"] = str(info.value)

    thread = threading.Thread(target=join)
    thread.start()
    # process 0 waits on for the right follower, and names the refusal when it never comes
    with pytest.raises(TimeoutError, match=r"cache\.num_blocks: process 0 has 13, this process has 14"):
        PlanServer("127.0.0.1", port, 2, CONFIG, secret=SECRET, timeout=1, compile_timeout=1, join_timeout=3)
    thread.join()
    assert "cache.num_blocks: process 0 has 13, this process has 14" in box["follower"]


def test_unreachable_coordinator_names_its_address():
    port = _port()
    with pytest.raises(ConnectionError, match=f"127.0.0.1:{port} within 0.5 s"):
        PlanClient("127.0.0.1", port, 1, _follower_config(), secret=SECRET, join_timeout=0.5)


def test_missing_follower_is_named_when_the_join_times_out():
    with pytest.raises(TimeoutError, match=r"processes \[1\] did not join within 0.3 s"):
        PlanServer("127.0.0.1", _port(), 2, CONFIG, secret=SECRET, timeout=1, compile_timeout=1, join_timeout=0.3)


def test_a_follower_that_dies_is_lost_at_once_and_sends_raise_after():
    server, client = _pair(timeout=5.0)
    client.close()  # what the kernel does for a killed process: the connection closes
    assert _lost_within(server, 5.0) < 2.0  # EOF, long before the 5 s silence bound
    assert "connection broke" in str(server.error)
    with pytest.raises(FollowerLost, match="process 1 is lost"):
        server.send_plan([b"x"])


def test_a_follower_error_is_reported_with_its_cause():
    server, client = _pair(timeout=5.0)
    told = []
    server.on_failure.append(told.append)
    client.report(RuntimeError("XLA compile failed"))
    _lost_within(server, 5.0)
    deadline = time.monotonic() + 5.0
    while not told and time.monotonic() < deadline:  # (the error is recorded just before the callbacks run)
        time.sleep(0.01)
    assert "XLA compile failed" in str(server.error) and told == [server.error]
    client.close()


def test_a_step_left_unacknowledged_is_lost_within_the_timeout():
    server, client = _pair(timeout=0.5)  # the client keeps beating but never acks: a hung step
    server.send_plan([b"step 1"])
    waited = _lost_within(server, 3.0)
    assert 0.3 < waited < 2.0 and "step 1 unfinished" in str(server.error)
    client.close()


def test_acknowledged_steps_keep_the_follower_alive():
    server, client = _pair(timeout=0.5)
    plans = client.plans()
    for step in range(1, 8):
        server.send_plan([b"step"])
        next(plans)
        client.ack(step)
        time.sleep(0.15)  # 1 s in all, twice the timeout: heartbeats and acks keep it alive
    assert server.error is None
    server.close()
    client.close()


def test_a_step_that_may_compile_gets_the_compile_timeout():
    server, client = _pair(timeout=0.5, compile_timeout=2.0)
    server.send_plan([b"step 1"], may_compile=True)
    time.sleep(1.0)  # twice the step timeout, half the compile timeout: still fine
    assert server.error is None
    waited = _lost_within(server, 3.0)
    assert "step 1 unfinished" in str(server.error) and "--compile-timeout 2" in str(server.error) and waited < 2.0
    client.close()


def test_a_silent_follower_is_lost_within_the_timeout():
    """A follower that joined and then says nothing (a stopped process: no heartbeats) is lost."""
    server, client = _pair(timeout=0.5)
    client._closing.set()  # its heartbeat thread stops, its connection stays open: SIGSTOP's effect
    _lost_within(server, 3.0)  # (timed from here, not from the join: no lower bound)
    assert "no word from it for" in str(server.error)
    client.close()


def test_a_stranger_on_the_port_is_ignored_and_the_follower_still_joins():
    """A connection that sends no hello (a port scan, a stray client) does not stop the join."""
    port, box = _port(), {}

    def join():
        with _connect(port) as stranger:
            stranger.sendall(b"\x01" + (2**40).to_bytes(8, "big"))  # a frame far too large for a hello
            time.sleep(0.2)
        box["client"] = PlanClient("127.0.0.1", port, 1, _follower_config(), secret=SECRET, join_timeout=10)

    thread = threading.Thread(target=join)
    thread.start()
    server = PlanServer("127.0.0.1", port, 2, CONFIG, secret=SECRET, timeout=1, compile_timeout=1, join_timeout=10)
    thread.join()
    server.send_plan([b"step 1"])
    server.close()
    assert [bytes(p) for p in box["client"].plans()] == [b"step 1"]
    box["client"].close()
