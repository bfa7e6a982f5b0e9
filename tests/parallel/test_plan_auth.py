"""The plan channel's authentication on loopback, without JAX: hostile joiners (a wrong secret, a
forged proof, a bad or taken process id, another config, garbage bytes, a hello that never finishes)
neither join nor stop the join, and the real follower still joins and gets its plans; a slow hello
is cut at its deadline; a follower refuses a leader that cannot prove the secret and never sends it
its config; frames are bound to their connection; the listener binds the coordinator's address
only; a missing, empty or short secret is refused naming where it comes from."""

import hashlib
import logging
import os
import socket
import threading
import time

import pytest

from jpaged.executors.plan_channel import PlanClient, PlanServer
from jpaged.executors.plan_link import AUTH, CHALLENGE, PROOF, REFUSE, SECRET_ENV, Link, plan_secret, recv_frame, send_frame
from tests.parallel.channel_pair import SECRET, free_port

CONFIG = {"model": {"name": "tiny-llama", "process_id": 0, "num_processes": 2}, "cache": {"num_blocks": 13}}
FOLLOWER = {"model": {**CONFIG["model"], "process_id": 1}, "cache": CONFIG["cache"]}


def _connect(port: int, host: str = "127.0.0.1", within: float = 10.0) -> socket.socket:
    """A connection to host:port, retried until the server listens (it binds after the joiner starts)."""
    deadline = time.monotonic() + within
    while True:
        try:
            return socket.create_connection((host, port), timeout=within)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the other side closes `sock` within `within` seconds (whatever it sent first is read)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def _join(port: int, process_id: int = 1, config: dict = FOLLOWER, secret: bytes = SECRET) -> PlanClient | str:
    """A follower's join: its PlanClient, or the text of the ValueError it was refused with (or of
    the ConnectionError it was dropped with: no refusal expects one)."""
    try:
        return PlanClient("127.0.0.1", port, process_id, config, secret=secret, join_timeout=10)
    except (ValueError, ConnectionError) as exc:
        return str(exc)


def test_hostile_joiners_neither_join_nor_stop_the_join(caplog):
    """Process 0 of 3 meets, in turn, garbage, a wrong secret, a forged proof, a bad process id,
    another config and a hello that never finishes; then two followers claim process id 1 and
    one claims 2. The first rank-1 and the rank-2 follower join; everyone else is refused or dropped."""
    port, box = free_port(), {}

    def hostile_then_real():
        with _connect(port) as garbage:
            garbage.sendall(os.urandom(64))  # not a frame the channel accepts
            box["garbage_dropped"] = _closed_by_peer(garbage, 5.0)
        box["wrong_secret"] = _join(port, secret=b"another secret of 32 bytes, ok!!")
        with _connect(port) as forger:  # a proof made up without the secret
            kind, _ = recv_frame(forger)
            send_frame(forger, AUTH, os.urandom(32), os.urandom(32))
            box["forged"] = (kind, recv_frame(forger)[0], _closed_by_peer(forger, 5.0))
        box["bad_rank"] = _join(port, process_id=5)
        box["other_config"] = _join(port, config={**FOLLOWER, "cache": {"num_blocks": 14}})
        loris = box["loris"] = _connect(port)  # starts its answer and never finishes it
        recv_frame(loris)
        loris.sendall(bytes([AUTH, 0, 0]))
        joins = [threading.Thread(target=lambda i=i, rank=rank: box.update({f"join{i}": _join(port, rank)}))
                 for i, rank in enumerate((1, 1, 2))]
        joins[0].start()
        joins[1].start()
        # Rank 2 only once one of the two rank-1 followers has been refused: the join ends when rank
        # 2 is in, and a follower still in its handshake then is dropped, not refused.
        deadline = time.monotonic() + 20
        while not any(isinstance(box.get(f"join{i}"), str) for i in (0, 1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        joins[2].start()
        for join in joins:
            join.join(30)

    caplog.set_level(logging.WARNING, logger="jpaged.executors.plan_channel")
    thread = threading.Thread(target=hostile_then_real)
    thread.start()
    start = time.monotonic()
    server = PlanServer("127.0.0.1", port, 3, CONFIG, secret=SECRET, timeout=2, compile_timeout=2, join_timeout=30,
                        handshake_timeout=20)
    joined_after = time.monotonic() - start
    server.send_plan([b"step 1"])
    server.close()
    thread.join(30)
    assert joined_after < 15  # the slow hello (20 s to finish) held nobody up
    clients = [box[f"join{i}"] for i in range(3) if isinstance(box[f"join{i}"], PlanClient)]
    assert len(clients) == 2
    for client in clients:
        assert [bytes(p) for p in client.plans()] == [b"step 1"]
        client.close()
    assert [box[f"join{i}"] for i in range(3) if isinstance(box[f"join{i}"], str)] == [
        "model.process_id: 1 joined already"]
    assert box["garbage_dropped"]
    assert "the plan secret differs from process 0's" in box["wrong_secret"]
    assert box["forged"] == (CHALLENGE, REFUSE, True)
    assert "model.process_id: must be in [1, 3) for a follower, got 5" in box["bad_rank"]
    assert "cache.num_blocks: process 0 has 13, this process has 14" in box["other_config"]
    assert _closed_by_peer(box["loris"], 5.0)  # dropped once the join was over
    box["loris"].close()
    logged = [r.getMessage() for r in caplog.records if r.name == "jpaged.executors.plan_channel"]
    assert sum("failed the handshake" in m for m in logged) == 3, logged  # garbage, wrong secret, forger
    assert sum("refused" in m for m in logged) == 3, logged  # bad rank, other config, rank 1 again


def test_a_hello_that_never_finishes_is_cut_at_its_deadline():
    """Bytes trickling in, each within a socket timeout, do not stretch the handshake's deadline."""
    port, box = free_port(), {}

    def trickle_then_join():
        with _connect(port) as loris:
            recv_frame(loris)
            start = time.monotonic()
            try:
                for byte in bytes([AUTH]) + (64).to_bytes(8, "big") + bytes(64):
                    loris.sendall(bytes([byte]))
                    time.sleep(0.1)  # 7 s for the whole answer
            except OSError:
                pass
            box["cut_after"] = time.monotonic() - start if _closed_by_peer(loris, 10.0) else None
        box["client"] = PlanClient("127.0.0.1", port, 1, FOLLOWER, secret=SECRET, join_timeout=10)

    thread = threading.Thread(target=trickle_then_join)
    thread.start()
    server = PlanServer("127.0.0.1", port, 2, CONFIG, secret=SECRET, timeout=2, compile_timeout=2, join_timeout=20,
                        handshake_timeout=0.5)
    thread.join(20)
    assert box["cut_after"] is not None and box["cut_after"] < 3.0
    server.close()
    box["client"].close()


def test_a_follower_refuses_a_leader_that_cannot_prove_the_secret():
    """A process posing as process 0 gets the follower's proof, never its config (nor its acks)."""
    with socket.create_server(("127.0.0.1", 0)) as fake:
        port, box = fake.getsockname()[1], {}

        def pose():
            sock, _ = fake.accept()
            with sock:
                send_frame(sock, CHALLENGE, os.urandom(32))
                box["answer"] = recv_frame(sock)[0]
                send_frame(sock, PROOF, os.urandom(32))
                box["then"] = _closed_by_peer(sock, 5.0)  # EOF, no hello with the config

        thread = threading.Thread(target=pose)
        thread.start()
        with pytest.raises(ValueError, match="did not prove it holds the plan secret"):
            PlanClient("127.0.0.1", port, 1, FOLLOWER, secret=SECRET, join_timeout=5)
        thread.join(10)
    assert box == {"answer": AUTH, "then": True}


def _wire(kind_payloads: list[tuple[int, bytes]], key: bytes) -> list[bytes]:
    """The bytes each frame is on the wire when a link keyed `key` sends it."""
    out, into = socket.socketpair()
    with out, into:
        link = Link(out, send_key=key, recv_key=b"")
        frames = []
        for kind, payload in kind_payloads:
            link.send(kind, payload)
            frames.append(into.recv(1 << 16))
        return frames


def _received(frames: list[bytes], key: bytes) -> list:
    """What a link keyed `key` makes of `frames`: (kind, payload) each, until the first error (its text)."""
    out, into = socket.socketpair()
    with out, into:
        out.sendall(b"".join(frames))
        link, got = Link(into, send_key=b"", recv_key=key), []
        for _ in frames:
            try:
                kind, payload = link.recv(deadline=time.monotonic() + 2)
            except ConnectionError as exc:
                return [*got, str(exc)]
            got.append((kind, bytes(payload)))
        return got


def test_frames_are_bound_to_their_connection():
    key = hashlib.sha256(b"one connection").digest()
    first, second = _wire([(3, b"plan one"), (3, b"plan two")], key)
    assert _received([first, second], key) == [(3, b"plan one"), (3, b"plan two")]
    altered = first[:10] + bytes([first[10] ^ 1]) + first[11:]
    assert _received([altered], key) == ["frame 0 failed its authentication check"]
    assert _received([first, first], key) == [(3, b"plan one"), "frame 1 failed its authentication check"]  # replay
    assert _received([second], key) == ["frame 0 failed its authentication check"]  # one dropped, or reordered
    other = hashlib.sha256(b"another connection").digest()
    assert _received(_wire([(3, b"plan one")], other), key) == ["frame 0 failed its authentication check"]


def test_the_listener_binds_the_coordinator_address_only():
    port, box = free_port(), {}

    def serve():
        with pytest.raises(TimeoutError):
            PlanServer("127.0.0.1", port, 2, CONFIG, secret=SECRET, timeout=1, compile_timeout=1, join_timeout=2)
        box["done"] = True

    thread = threading.Thread(target=serve)
    thread.start()
    _connect(port).close()  # listening on 127.0.0.1 ...
    with pytest.raises(ConnectionRefusedError):  # ... and on no other loopback address
        socket.create_connection(("127.0.0.2", port), timeout=2)
    thread.join(10)
    assert box == {"done": True}


def test_a_missing_empty_or_short_secret_is_refused_naming_its_source(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=f"--plan-secret-file PATH or \\${SECRET_ENV}"):
        plan_secret(None)
    monkeypatch.setenv(SECRET_ENV, "")
    with pytest.raises(ValueError, match=f"\\${SECRET_ENV}: the plan secret must be at least 16 bytes, got 0 bytes"):
        plan_secret(None)
    short = tmp_path / "short"
    short.write_text("fifteen bytes!!\n")
    with pytest.raises(ValueError, match=f"--plan-secret-file {short}: .* at least 16 bytes, got 15 bytes"):
        plan_secret(str(short))
    with pytest.raises(OSError, match=f"--plan-secret-file: cannot read {tmp_path / 'absent'}"):
        plan_secret(str(tmp_path / "absent"))
    good = tmp_path / "secret"
    good.write_text(SECRET.decode() + "\n")
    monkeypatch.setenv(SECRET_ENV, "the variable's secret, long enough")
    assert plan_secret(str(good)) == SECRET  # the file first, without its newline
    assert plan_secret(None) == b"the variable's secret, long enough"
    with pytest.raises(ValueError, match="at least 16 bytes, got 5 bytes"):
        PlanServer("127.0.0.1", free_port(), 2, CONFIG, secret=b"short", timeout=1, compile_timeout=1, join_timeout=1)
