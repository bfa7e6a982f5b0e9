"""The plan channel: a TCP connection from process 0 to each follower, beside jax.distributed.

Process 0 (`PlanServer`) listens; each follower (`PlanClient`) connects, proves it holds the run's
secret (Authentication, below), says who it is and sends its engine config; process 0 compares
every field with its own and refuses a follower whose config differs, naming the field. Then, for
every step, process 0 sends the encoded StepPlan (jpaged.executors.plan_wire) to every follower, in
order, and each follower answers with an ack once it ran the step. Followers also send a heartbeat every `timeout / 4` seconds from a thread of their own.

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

Authentication (jpaged.executors.plan_link): a follower proves it holds the run's shared secret,
and process 0 proves it back, before its HELLO; every frame after is tagged (`Link`).

Process 0 runs each connection's handshake in its own thread with a deadline of its own
(`handshake_timeout`), so a connection that fails the handshake, sends garbage, names a bad or taken
process id, sends a different config, or starts a hello and never finishes it is logged and
dropped (a real follower learns why) while the join keeps waiting for the real followers; the
refusals are named in the TimeoutError when they never come. The listener binds the coordinator's
address only.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator

from jpaged.executors.plan_link import (ACK, AUTH, CHALLENGE, ERROR, FOLLOWER_PROOF, HEARTBEAT, HELLO, LEADER_PROOF,
                                       NONCE_BYTES, PLAN, PROOF, REFUSE, SECRET_ENV, STEP, STOP, TAG_BYTES,
                                       TO_FOLLOWER, TO_LEADER, WELCOME, Link, check_secret, derive, recv_frame,
                                       send_frame)

logger = logging.getLogger(__name__)

_MAX_HANDSHAKES = 64  # connections in their handshake at once; more are dropped at once
_ACCEPT_POLL_S = 0.05  # how often the join loop looks at finished handshakes between accepts
_IGNORED_FIELDS = ("model.process_id",)  # the only field that differs between the processes of one run


class FollowerLost(RuntimeError):
    """A follower died, hung or failed: the processes cannot run another step together."""


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


def _drop(sock: socket.socket) -> None:
    """Closes `sock`, waking a thread blocked reading it (close alone does not, on Linux)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class PlanServer:
    """Process 0's end: accepts the followers, sends them every plan, watches that they keep up."""

    def __init__(self, host: str, port: int, num_processes: int, config: dict, *, secret: bytes, timeout: float,
                 compile_timeout: float, join_timeout: float, handshake_timeout: float = 10.0):
        """Listens on host:port (that address only) and returns once the `num_processes - 1` followers joined.

        `secret`: the run's shared secret (`plan_secret`); a connection that does not prove it holds
        it is dropped. `config`: this process's engine config as a JSON-ready dict; a follower whose
        config differs, or whose process id is out of range or taken, is refused (it learns why) and
        dropped, and the join waits on. TimeoutError names the missing process ids, and the last
        refusals, when they have not all joined within `join_timeout` seconds. Each connection has
        `handshake_timeout` seconds to prove the secret and say hello. `timeout`: seconds of
        follower silence, or of an unacknowledged step, that count as a loss; `compile_timeout`
        replaces it for a step sent with `may_compile`.
        """
        if not timeout > 0 or not compile_timeout > 0 or not join_timeout > 0 or not handshake_timeout > 0:
            raise ValueError(f"follower, compile, join and handshake timeouts must be > 0 seconds, got {timeout}, "
                             f"{compile_timeout}, {join_timeout} and {handshake_timeout}")
        check_secret(secret)
        self.timeout, self.compile_timeout = timeout, compile_timeout
        self.error: FollowerLost | None = None
        self.on_failure: list[Callable[[FollowerLost], None]] = []
        self._secret, self._handshake_timeout = secret, handshake_timeout
        self._config = json.loads(json.dumps(config, default=str))  # as the followers' copies arrive: through JSON
        self._lock = threading.Lock()  # sends (the engine thread) against close (the main thread)
        self._fail_lock = threading.Lock()  # the reader threads and the watchdog may find a loss at once
        self._closing = threading.Event()
        self._stopping = threading.Event()  # close() has told the followers to stop
        self._step = 0
        self._deadline: dict[int, tuple[float, float]] = {}  # step -> (sent at, seconds allowed), until all acked
        self._followers: dict[int, Link] = {}
        self._acked: dict[int, int] = {}
        self._heard: dict[int, float] = {}
        listener = socket.create_server((host, port), reuse_port=False)
        try:
            self._accept(listener, num_processes, join_timeout)
        except BaseException:
            for link in self._followers.values():
                link.sock.close()
            raise
        finally:
            listener.close()
        welcome = json.dumps({"heartbeat_interval": timeout / 4}).encode()
        for link in self._followers.values():
            link.sock.settimeout(timeout)  # a send to a follower that stopped reading fails within the bound
            link.send(WELCOME, welcome)
        now = time.monotonic()
        for rank, link in self._followers.items():
            self._acked[rank], self._heard[rank] = 0, now
            threading.Thread(target=self._read, args=(rank, link), name=f"jpaged-follower-{rank}", daemon=True).start()
        threading.Thread(target=self._watch, name="jpaged-follower-watchdog", daemon=True).start()

    def _accept(self, listener: socket.socket, num_processes: int, join_timeout: float) -> None:
        """Accepts connections until every follower joined: each one's handshake runs in a thread of
        its own (`_greet`), and this loop admits or refuses those that said hello (`_admit`)."""
        deadline = time.monotonic() + join_timeout
        greeted: queue.Queue[tuple[Link, object, object]] = queue.Queue()  # (link, peer, hello)
        pending: set[socket.socket] = set()  # connections still in their handshake
        pending_lock = threading.Lock()
        refusals: dict[str, object] = {}  # why -> the peer refused last for it (for the timeout's message)
        listener.settimeout(_ACCEPT_POLL_S)
        try:
            while len(self._followers) < num_processes - 1:
                if time.monotonic() >= deadline:
                    missing = sorted(set(range(1, num_processes)) - set(self._followers))
                    refused = "".join(f"; refused {peer}: {why}" for why, peer in list(refusals.items())[-3:])
                    raise TimeoutError(f"processes {missing} did not join within {join_timeout} s (--join-timeout); "
                                       f"started with the same --coordinator-address?{refused}")
                try:
                    sock, peer = listener.accept()
                except TimeoutError:
                    pass
                else:
                    with pending_lock:
                        crowded = len(pending) >= _MAX_HANDSHAKES
                        if not crowded:
                            pending.add(sock)
                    if crowded:
                        logger.warning("plan channel: dropped a connection from %s: %d others are in their "
                                       "handshake", peer, _MAX_HANDSHAKES)
                        sock.close()
                    else:
                        threading.Thread(target=self._greet, args=(sock, peer, greeted, pending, pending_lock),
                                         name="jpaged-plan-handshake", daemon=True).start()
                while not greeted.empty():
                    link, peer, hello = greeted.get()
                    why = self._admit(link, peer, hello, num_processes)
                    if why is not None:
                        refusals.pop(why, None)
                        refusals[why] = peer
        finally:
            with pending_lock:  # handshakes still running: their threads end on the closed socket
                for sock in pending:
                    _drop(sock)
                pending.clear()
            while not greeted.empty():
                _drop(greeted.get()[0].sock)

    def _greet(self, sock: socket.socket, peer, greeted: queue.Queue, pending: set[socket.socket],
               pending_lock: threading.Lock) -> None:
        """One connection's handshake (its own thread): challenge, check its proof, prove ours, read
        its hello, all within `handshake_timeout`; then hands (link, peer, hello) to the join loop.
        A connection that fails is logged and dropped."""
        deadline = time.monotonic() + self._handshake_timeout
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ours = secrets.token_bytes(NONCE_BYTES)
            sock.settimeout(self._handshake_timeout)
            send_frame(sock, CHALLENGE, ours)
            kind, payload = recv_frame(sock, limit=NONCE_BYTES + TAG_BYTES, deadline=deadline)
            if kind != AUTH or len(payload) != NONCE_BYTES + TAG_BYTES:
                raise ConnectionError(f"it answered the challenge with frame kind {kind} of {len(payload)} bytes")
            theirs, proof = bytes(payload[:NONCE_BYTES]), bytes(payload[NONCE_BYTES:])
            if not hmac.compare_digest(proof, derive(self._secret, FOLLOWER_PROOF, ours, theirs)):
                send_frame(sock, REFUSE, json.dumps({"error": "the plan secret differs from process 0's "
                                                              f"(--plan-secret-file / ${SECRET_ENV})"}).encode())
                raise ConnectionError("its proof of the plan secret is wrong")
            send_frame(sock, PROOF, derive(self._secret, LEADER_PROOF, ours, theirs))
            link = Link(sock, send_key=derive(self._secret, TO_FOLLOWER, ours, theirs),
                         recv_key=derive(self._secret, TO_LEADER, ours, theirs))
            kind, payload = link.recv(limit=2**24, deadline=deadline)  # a config
            if kind != HELLO:
                raise ConnectionError(f"it sent frame kind {kind}, not a hello")
            hello = _json(payload)
        except (OSError, ValueError) as exc:  # (a JSON error is a ValueError)
            with pending_lock:
                mine = sock in pending
                pending.discard(sock)
            if mine:  # (else the join is over and dropped it)
                logger.warning("plan channel: dropped a connection from %s that failed the handshake: %s", peer,
                               exc if str(exc) else type(exc).__name__)
                _drop(sock)
            return
        with pending_lock:
            mine = sock in pending
            pending.discard(sock)
            if mine:
                greeted.put((link, peer, hello))

    def _admit(self, link: Link, peer, hello, num_processes: int) -> str | None:
        """Takes an authenticated connection's hello as a follower, or refuses it (it learns why),
        logs and drops it: returns why, or None once it joined."""
        rank = hello.get("process_id") if isinstance(hello, dict) else None
        if not isinstance(hello, dict):
            problem = f"its hello is not a JSON object: {hello!r:.100}"
        elif not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank < num_processes:
            problem = f"model.process_id: must be in [1, {num_processes}) for a follower, got {rank!r:.100}"
        elif rank in self._followers:
            problem = f"model.process_id: {rank} joined already"
        else:
            theirs = hello.get("config")
            mismatch = config_mismatch(self._config, theirs if isinstance(theirs, dict) else {})
            problem = f"config mismatch between process 0 and process {rank}: {mismatch}" if mismatch else None
        if problem is None:
            self._followers[rank] = link
            logger.info("process %d joined from %s", rank, peer)
            return None
        logger.warning("plan channel: refused %s: %s", peer, problem)
        try:
            link.send(REFUSE, json.dumps({"error": problem}).encode())
        except OSError:
            pass
        _drop(link.sock)
        return problem

    def send_plan(self, buffers: list[bytes | memoryview], may_compile: bool = False) -> None:
        """Sends one step's encoded plan to every follower, in order; FollowerLost once one is lost.

        `may_compile`: the step may compile a program (it gets `compile_timeout`, not `timeout`)."""
        if self.error is not None:
            raise self.error
        with self._lock:
            self._step += 1
            self._deadline[self._step] = (time.monotonic(), self.compile_timeout if may_compile else self.timeout)
            for rank, link in self._followers.items():
                try:
                    link.send(PLAN, *buffers)
                except OSError as exc:
                    self._fail(rank, f"sending step {self._step} failed: {exc!r}")
                    raise self.error from exc

    def close(self) -> None:
        """Tells every follower to stop (it exits 0), waits (at most the follower timeout) for the
        acks of the steps they are still running, then closes the connections: closing first would
        reset a follower's last ack, and it would fail instead of stopping."""
        self._stopping.set()  # from now on a follower that hangs up is stopping, not lost
        with self._lock:
            for link in self._followers.values():
                try:
                    link.send(STOP)
                except OSError:
                    pass
        deadline = time.monotonic() + min(self.timeout, 10.0)
        while time.monotonic() < deadline and min(self._acked.values(), default=0) < self._step:
            time.sleep(0.005)
        self._closing.set()
        with self._lock:
            for link in self._followers.values():
                link.sock.close()

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

    def _read(self, rank: int, link: Link) -> None:
        """Acks, heartbeats and errors from one follower, until it or this side closes."""
        try:
            while True:
                kind, payload = link.recv(self._closing)
                self._heard[rank] = time.monotonic()
                if kind == ACK:
                    self._acked[rank] = STEP.unpack(payload)[0]
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

    def __init__(self, host: str, port: int, process_id: int, config: dict, *, secret: bytes, join_timeout: float):
        """Connects (retrying while process 0 is not listening yet), proves it holds `secret`, checks
        that process 0 does too, and only then sends its process id and config and joins.

        ConnectionError names host:port when nothing answers within `join_timeout` seconds;
        ValueError carries process 0's refusal (the secret, a config field that differs, a process
        id in use) or says that the other side did not prove it holds the secret.
        """
        check_secret(secret)
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
        self._lock = threading.Lock()  # acks (main thread) against heartbeats (their thread)
        self._closing = threading.Event()
        try:
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._link = self._authenticate(secret, f"{host}:{port}", deadline)
            self._link.send(HELLO, json.dumps({"process_id": process_id, "config": config}, default=str).encode())
            try:
                kind, payload = self._link.recv(deadline=deadline)
            except TimeoutError:
                raise ConnectionError(f"the coordinator at {host}:{port} did not answer within {join_timeout} s "
                                      f"(--join-timeout): not all processes joined?") from None
            if kind == REFUSE:
                raise ValueError(_json(payload)["error"])
            if kind != WELCOME:
                raise ConnectionError(f"the coordinator at {host}:{port} answered with frame kind {kind}, not WELCOME")
        except BaseException:
            self._sock.close()
            raise
        self._sock.settimeout(None)  # a follower waits for plans as long as process 0 lives
        interval = _json(payload)["heartbeat_interval"]
        threading.Thread(target=self._beat, args=(interval,), name="jpaged-heartbeat", daemon=True).start()

    def _authenticate(self, secret: bytes, address: str, deadline: float) -> Link:
        """The follower's half of the handshake: answers process 0's challenge with its own nonce
        and proof, checks process 0's proof; the link keyed for this connection."""
        try:
            kind, payload = recv_frame(self._sock, limit=NONCE_BYTES, deadline=deadline)
        except TimeoutError:
            raise ConnectionError(f"the process at {address} sent no challenge: not a jpaged plan channel?") from None
        if kind != CHALLENGE or len(payload) != NONCE_BYTES:
            raise ConnectionError(f"the process at {address} is not a jpaged plan channel (it sent frame kind {kind})")
        theirs, ours = bytes(payload), secrets.token_bytes(NONCE_BYTES)
        send_frame(self._sock, AUTH, ours, derive(secret, FOLLOWER_PROOF, theirs, ours))
        kind, payload = recv_frame(self._sock, limit=2**16, deadline=deadline)
        if kind == REFUSE:
            raise ValueError(_json(payload)["error"])
        if kind != PROOF or not hmac.compare_digest(bytes(payload), derive(secret, LEADER_PROOF, theirs, ours)):
            raise ValueError(f"the process at {address} did not prove it holds the plan secret: not process 0, "
                             f"or its secret differs (--plan-secret-file / ${SECRET_ENV})")
        return Link(self._sock, send_key=derive(secret, TO_LEADER, theirs, ours),
                     recv_key=derive(secret, TO_FOLLOWER, theirs, ours))

    def plans(self) -> Iterator[bytearray]:
        """Each step's encoded plan, in order, until process 0 says stop.

        ConnectionError when process 0 goes away without saying stop.
        """
        while True:
            try:
                kind, payload = self._link.recv()
            except OSError as exc:
                raise ConnectionError(f"the plan channel from process 0 broke without a stop ({exc})") from None
            if kind == STOP:
                return
            if kind != PLAN:
                raise ConnectionError(f"unexpected frame kind {kind} from process 0")
            yield payload

    def ack(self, step: int) -> None:
        """Tells process 0 that step `step` (counted from 1) ran here."""
        with self._lock:
            self._link.send(ACK, STEP.pack(step))

    def report(self, error: BaseException) -> None:
        """Tells process 0 why this follower stops (best effort: the connection may be gone)."""
        try:
            with self._lock:
                self._link.send(ERROR, json.dumps({"error": repr(error)}).encode())
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
                    self._link.send(HEARTBEAT)
            except OSError:
                return
