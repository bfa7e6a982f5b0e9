"""The plan channel: a TCP connection from process 0 to each follower, beside jax.distributed.

Process 0 (`PlanServer`) listens; each follower (`PlanClient`) connects, says who it is and sends its
engine config; process 0 compares every field with its own and refuses a follower whose config
differs, naming the field. Then, for every step, process 0 sends the encoded StepPlan
(jpaged.executors.plan_wire) to every follower, in order, and each follower answers with an ack once
it ran the step. Followers also send a heartbeat every `timeout / 4` seconds from a thread of their own.

Why a socket and not a JAX collective (docs/notes/parallel.md has the per-step costs): a plan
changes size every step, so a collective broadcast needs its length first and a padded buffer after
(two collectives, both blocking the device stream); and a collective whose peer died never returns,
while a socket says so at once (EOF) or within its timeout.

Failure detection on process 0 (one reader thread per follower and a watchdog thread): a follower
that closes its connection, reports an error, stays silent longer than `timeout` (no heartbeat), or
leaves a sent step unacknowledged for longer than its deadline is lost. A step's deadline is
`timeout`, or `compile_timeout` for a step the sender marks as possibly compiling (a shape not run
before): a step cannot be told apart from its compilation, and compiling may take far longer than
running. Heartbeats keep flowing while a follower compiles (XLA releases the GIL), so a dead or
stopped follower is still found within `timeout` then. The first loss is recorded in
`error` and passed to every `on_failure` callback, from whichever thread found it: the step that
waits on the dead follower may be stuck in a collective that never returns, so the callbacks cannot
wait for it. Every later `send_plan` raises the same error.

Frames: 1 byte kind, 8 bytes length (big-endian), then the payload.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

HELLO, WELCOME, REFUSE, PLAN, STOP, ACK, HEARTBEAT, ERROR = range(8)
_FRAME = struct.Struct("!BQ")
_STEP = struct.Struct("!Q")
_IGNORED_FIELDS = ("model.process_id",)  # the only field that differs between the processes of one run


class FollowerLost(RuntimeError):
    """A follower died, hung or failed: the processes cannot run another step together."""


def send_frame(sock: socket.socket, kind: int, *buffers: bytes | memoryview) -> None:
    """One frame: its header, then `buffers` back to back."""
    size = sum(memoryview(b).nbytes for b in buffers)
    sock.sendall(_FRAME.pack(kind, size))
    for buffer in buffers:
        sock.sendall(buffer)


def _recv_exact(sock: socket.socket, size: int, closing: threading.Event | None = None) -> bytearray:
    """Exactly `size` bytes; ConnectionError on EOF. With `closing`, a socket timeout only means
    "nothing yet" and the read goes on until the event is set (the watchdog judges silence)."""
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            if closing is None or closing.is_set():
                raise
            continue
        if n == 0:
            raise ConnectionError("connection closed by the other side")
        got += n
    return data


def recv_frame(sock: socket.socket, closing: threading.Event | None = None, limit: int = 2**30) -> tuple[int, bytearray]:
    """One frame: (kind, payload); ValueError for a payload over `limit` bytes (not one of ours)."""
    kind, size = _FRAME.unpack(_recv_exact(sock, _FRAME.size, closing))
    if size > limit:
        raise ValueError(f"a frame of {size} bytes, more than the {limit} allowed")
    return kind, _recv_exact(sock, size, closing)


def config_mismatch(ours: dict, theirs: dict, prefix: str = "") -> str | None:
    """The first config field (dotted path) whose values differ, with both values; None if none does.

    `model.process_id` is ignored: it is the one field that must differ.
    """
    for key in sorted(set(ours) | set(theirs)):
        path = f"{prefix}{key}"
        if path in _IGNORED_FIELDS:
            continue
        a, b = ours.get(key, "<missing>"), theirs.get(key, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict):
            found = config_mismatch(a, b, f"{path}.")
            if found:
                return found
        elif a != b:
            return f"{path}: process 0 has {a!r}, this process has {b!r}"
    return None


def _json(payload: bytearray) -> dict:
    return json.loads(bytes(payload))


class PlanServer:
    """Process 0's end: accepts the followers, sends them every plan, watches that they keep up."""

    def __init__(self, host: str, port: int, num_processes: int, config: dict, *, timeout: float,
                 compile_timeout: float, join_timeout: float):
        """Listens on host:port and returns once the `num_processes - 1` followers joined.

        `config`: this process's engine config as a JSON-ready dict; a follower whose config differs
        is refused (it learns the field) and ValueError names the field here too. TimeoutError
        names the missing process ids when they have not all joined within `join_timeout` seconds.
        `timeout`: seconds of follower silence, or of an unacknowledged step, that count as a loss;
        `compile_timeout` replaces it for a step sent with `may_compile`.
        """
        if not timeout > 0 or not compile_timeout > 0 or not join_timeout > 0:
            raise ValueError(f"follower, compile and join timeouts must be > 0 seconds, got {timeout}, "
                             f"{compile_timeout} and {join_timeout}")
        self.timeout, self.compile_timeout = timeout, compile_timeout
        self.error: FollowerLost | None = None
        self.on_failure: list[Callable[[FollowerLost], None]] = []
        self._config = json.loads(json.dumps(config, default=str))  # as the followers' copies arrive: through JSON
        self._lock = threading.Lock()  # sends (the engine thread) against close (the main thread)
        self._fail_lock = threading.Lock()  # the reader threads and the watchdog may find a loss at once
        self._closing = threading.Event()
        self._stopping = threading.Event()  # close() has told the followers to stop
        self._step = 0
        self._deadline: dict[int, tuple[float, float]] = {}  # step -> (sent at, seconds allowed), until all acked
        self._followers: dict[int, socket.socket] = {}
        self._acked: dict[int, int] = {}
        self._heard: dict[int, float] = {}
        listener = socket.create_server((host, port), reuse_port=False)
        try:
            self._accept(listener, num_processes, join_timeout)
        except BaseException:
            for sock in self._followers.values():
                sock.close()
            raise
        finally:
            listener.close()
        welcome = json.dumps({"heartbeat_interval": timeout / 4}).encode()
        for sock in self._followers.values():
            sock.settimeout(timeout)  # a send to a follower that stopped reading fails within the bound
            send_frame(sock, WELCOME, welcome)
        now = time.monotonic()
        for rank, sock in self._followers.items():
            self._acked[rank], self._heard[rank] = 0, now
            threading.Thread(target=self._read, args=(rank, sock), name=f"jpaged-follower-{rank}", daemon=True).start()
        threading.Thread(target=self._watch, name="jpaged-follower-watchdog", daemon=True).start()

    def _accept(self, listener: socket.socket, num_processes: int, join_timeout: float) -> None:
        deadline = time.monotonic() + join_timeout
        while len(self._followers) < num_processes - 1:
            listener.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                sock, peer = listener.accept()
            except TimeoutError:
                missing = sorted(set(range(1, num_processes)) - set(self._followers))
                raise TimeoutError(f"processes {missing} did not join within {join_timeout} s "
                                   f"(--join-timeout); started with the same --coordinator-address?") from None
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                kind, payload = recv_frame(sock, limit=2**24)  # a config, from whoever connected
                hello = _json(payload) if kind == HELLO else None
            except (OSError, ValueError) as exc:
                hello = exc
            if not isinstance(hello, dict):
                logger.warning("ignoring a connection from %s that did not say hello: %s", peer, hello)
                sock.close()
                continue
            rank, problem = hello.get("process_id"), None
            if not isinstance(rank, int) or not 1 <= rank < num_processes:
                problem = f"model.process_id: must be in [1, {num_processes}) for a follower, got {rank!r}"
            elif rank in self._followers:
                problem = f"model.process_id: {rank} joined twice"
            else:
                mismatch = config_mismatch(self._config, hello.get("config", {}))
                problem = f"config mismatch between process 0 and process {rank}: {mismatch}" if mismatch else None
            if problem:
                send_frame(sock, REFUSE, json.dumps({"error": problem}).encode())
                sock.close()
                raise ValueError(problem)
            self._followers[rank] = sock
            logger.info("process %d joined from %s", rank, peer)

    def send_plan(self, buffers: list[bytes | memoryview], may_compile: bool = False) -> None:
        """Sends one step's encoded plan to every follower, in order; FollowerLost once one is lost.

        `may_compile`: the step may compile a program (it gets `compile_timeout`, not `timeout`)."""
        if self.error is not None:
            raise self.error
        with self._lock:
            self._step += 1
            self._deadline[self._step] = (time.monotonic(), self.compile_timeout if may_compile else self.timeout)
            for rank, sock in self._followers.items():
                try:
                    send_frame(sock, PLAN, *buffers)
                except OSError as exc:
                    self._fail(rank, f"sending step {self._step} failed: {exc!r}")
                    raise self.error from exc

    def close(self) -> None:
        """Tells every follower to stop (it exits 0), waits (at most the follower timeout) for the
        acks of the steps they are still running, then closes the connections: closing first would
        reset a follower's last ack, and it would fail instead of stopping."""
        self._stopping.set()  # from now on a follower that hangs up is stopping, not lost
        with self._lock:
            for sock in self._followers.values():
                try:
                    send_frame(sock, STOP)
                except OSError:
                    pass
        deadline = time.monotonic() + min(self.timeout, 10.0)
        while time.monotonic() < deadline and min(self._acked.values(), default=0) < self._step:
            time.sleep(0.005)
        self._closing.set()
        with self._lock:
            for sock in self._followers.values():
                sock.close()

    def _fail(self, rank: int, why: str) -> None:
        """Records the first loss and tells the callbacks (later ones are logged only)."""
        if self._closing.is_set() or self._stopping.is_set():
            return
        error = FollowerLost(f"process {rank} is lost: {why}")
        with self._fail_lock:
            first = self.error is None
            if first:
                self.error = error
        logger.error("%s", error)
        if first:
            for callback in self.on_failure:
                callback(error)

    def _read(self, rank: int, sock: socket.socket) -> None:
        """Acks, heartbeats and errors from one follower, until it or this side closes."""
        try:
            while True:
                kind, payload = recv_frame(sock, self._closing)
                self._heard[rank] = time.monotonic()
                if kind == ACK:
                    self._acked[rank] = _STEP.unpack(payload)[0]
                elif kind == ERROR:
                    self._fail(rank, f"it failed: {_json(payload).get('error')}")
                    return
        except (OSError, ValueError) as exc:
            self._fail(rank, f"its connection broke ({exc})")

    def _watch(self) -> None:
        """Every tenth of the timeout: a follower silent, or a step unacknowledged, past its bound is lost."""
        while not self._closing.wait(self.timeout / 10) and self.error is None:
            now = time.monotonic()
            for rank in self._followers:
                silent = now - self._heard[rank]
                sent, allowed = self._deadline.get(self._acked[rank] + 1, (now, 0.0))
                if silent > self.timeout:
                    self._fail(rank, f"no word from it for {silent:.1f} s (--follower-timeout {self.timeout:g})")
                elif now - sent > allowed:
                    flag = "--compile-timeout" if allowed == self.compile_timeout else "--follower-timeout"
                    self._fail(rank, f"step {self._acked[rank] + 1} unfinished after {now - sent:.1f} s "
                                     f"({flag} {allowed:g})")
            done = min(self._acked.values(), default=self._step)
            for step in [s for s in list(self._deadline) if s <= done]:  # (a copy: send_plan adds steps meanwhile)
                self._deadline.pop(step, None)


class PlanClient:
    """A follower's end: joins process 0, yields its plans, acknowledges each step, sends heartbeats."""

    def __init__(self, host: str, port: int, process_id: int, config: dict, *, join_timeout: float):
        """Connects (retrying while process 0 is not listening yet) and joins.

        ConnectionError names host:port when nothing answers within `join_timeout` seconds;
        ValueError carries process 0's refusal (a config field that differs, a process id in use).
        """
        deadline = time.monotonic() + join_timeout
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.001))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"cannot reach the coordinator's plan channel at {host}:{port} within "
                                          f"{join_timeout} s (--join-timeout): {exc}") from None
                time.sleep(0.2)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()  # acks (main thread) against heartbeats (their thread)
        self._closing = threading.Event()
        send_frame(self._sock, HELLO, json.dumps({"process_id": process_id, "config": config}, default=str).encode())
        self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            kind, payload = recv_frame(self._sock)
        except TimeoutError:
            raise ConnectionError(f"the coordinator at {host}:{port} did not answer within {join_timeout} s "
                                  f"(--join-timeout): not all processes joined?") from None
        if kind == REFUSE:
            raise ValueError(_json(payload)["error"])
        if kind != WELCOME:
            raise ConnectionError(f"the coordinator at {host}:{port} answered with frame kind {kind}, not WELCOME")
        self._sock.settimeout(None)  # a follower waits for plans as long as process 0 lives
        interval = _json(payload)["heartbeat_interval"]
        threading.Thread(target=self._beat, args=(interval,), name="jpaged-heartbeat", daemon=True).start()

    def plans(self) -> Iterator[bytearray]:
        """Each step's encoded plan, in order, until process 0 says stop.

        ConnectionError when process 0 goes away without saying stop.
        """
        while True:
            try:
                kind, payload = recv_frame(self._sock)
            except OSError as exc:
                raise ConnectionError(f"process 0 closed the plan channel without a stop ({exc})") from None
            if kind == STOP:
                return
            if kind != PLAN:
                raise ConnectionError(f"unexpected frame kind {kind} from process 0")
            yield payload

    def ack(self, step: int) -> None:
        """Tells process 0 that step `step` (counted from 1) ran here."""
        with self._lock:
            send_frame(self._sock, ACK, _STEP.pack(step))

    def report(self, error: BaseException) -> None:
        """Tells process 0 why this follower stops (best effort: the connection may be gone)."""
        try:
            with self._lock:
                send_frame(self._sock, ERROR, json.dumps({"error": repr(error)}).encode())
        except OSError:
            pass

    def close(self) -> None:
        """Stops the heartbeats and closes the connection."""
        self._closing.set()
        self._sock.close()

    def _beat(self, interval: float) -> None:
        while not self._closing.wait(interval):
            try:
                with self._lock:
                    send_frame(self._sock, HEARTBEAT)
            except OSError:
                return
