"""A joined plan-channel pair (process 0's server, a follower's client) on a free loopback port."""

from __future__ import annotations

import socket
import threading

from jpaged.executors.plan_channel import PlanClient, PlanServer

SECRET = b"a test secret of 32 bytes, ok.!!"  # the run's shared secret in the channel tests


def free_port() -> int:
    """A loopback TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def joined_pair(server_config: dict, client_config: dict, timeout: float = 1.0,
                compile_timeout: float | None = None) -> tuple[PlanServer, PlanClient]:
    """(server, client) after the join; the client is process 1 of 2."""
    port, box = free_port(), {}

    def join():
        box["client"] = PlanClient("127.0.0.1", port, 1, client_config, secret=SECRET, join_timeout=10)

    thread = threading.Thread(target=join)
    thread.start()
    server = PlanServer("127.0.0.1", port, 2, server_config, secret=SECRET, timeout=timeout,
                        compile_timeout=compile_timeout or timeout, join_timeout=10)
    thread.join()
    return server, box["client"]
