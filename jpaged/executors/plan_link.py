"""The plan channel's wire: frames, the run's shared secret, and connections that prove it.

Authentication: a connection proves it holds the run's shared secret before anything else crosses
it. Process 0 sends a CHALLENGE (its random nonce); the follower answers AUTH (its own nonce and
HMAC-SHA256(secret, follower label, both nonces)); process 0 checks it (hmac.compare_digest) and
answers PROOF (the same HMAC under the leader's label), which the follower checks in turn: each side
knows the other holds the secret, and the labels keep either proof from being reflected back. Only
then does the follower send its HELLO (process id and config), and from then on every frame in
either direction carries an HMAC-SHA256 tag over its direction's frame count, kind and payload,
keyed by a per-connection key derived from the secret and both nonces: plans, acks, heartbeats and
error reports are bound to the authenticated connection (a frame injected, altered, replayed or
dropped on the path fails the check and breaks the connection). Nothing is encrypted: an observer on
the path reads the plans (token ids); use a private network or a tunnel where that matters.

The secret (`plan_secret`): `--plan-secret-file` or $JPAGED_PLAN_SECRET, at least 16 bytes, the same
on every process; a multi-process run without one is refused at start-up, whatever its address.
No secret is generated for a run on one host: `jpaged serve` processes start independently, so
there is no channel to hand a generated secret over before the plan channel itself, and a loopback
port is open to every local user. The followers' whole trust rests on this secret: whoever holds it
can join as a follower (and read every plan) or lead the followers.

Frames: 1 byte kind, 8 bytes length (big-endian), then the payload (then, once authenticated, the
32-byte tag, counted in the length).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import threading
import time
from pathlib import Path

# Frame kinds.
HELLO, WELCOME, REFUSE, PLAN, STOP, ACK, HEARTBEAT, ERROR, CHALLENGE, AUTH, PROOF = range(11)
_FRAME = struct.Struct("!BQ")
STEP = struct.Struct("!Q")  # a step number (acks; each frame's count in its tag)
SECRET_ENV = "JPAGED_PLAN_SECRET"
MIN_SECRET_BYTES = 16
NONCE_BYTES = 32
TAG_BYTES = hashlib.sha256().digest_size  # 32
# Labels of the four values derived from the secret and a connection's two nonces: one proof per
# side, one frame key per direction.
FOLLOWER_PROOF, LEADER_PROOF = b"jpaged plan: follower proof", b"jpaged plan: leader proof"
TO_LEADER, TO_FOLLOWER = b"jpaged plan: follower to leader", b"jpaged plan: leader to follower"




def send_frame(sock: socket.socket, kind: int, *buffers: bytes | memoryview) -> None:
    """One frame: its header, then `buffers` back to back."""
    size = sum(memoryview(b).nbytes for b in buffers)
    sock.sendall(_FRAME.pack(kind, size))
    for buffer in buffers:
        sock.sendall(buffer)


def _recv_exact(sock: socket.socket, size: int, closing: threading.Event | None = None,
                deadline: float | None = None) -> bytearray:
    """Exactly `size` bytes; ConnectionError on EOF. With `closing`, a socket timeout only means
    "nothing yet" and the read goes on until the event is set (the watchdog judges silence). With
    `deadline` (time.monotonic()), TimeoutError once it passes, however the bytes trickle in."""
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {size} bytes by the deadline")
            sock.settimeout(left)
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


def recv_frame(sock: socket.socket, closing: threading.Event | None = None, limit: int = 2**30,
               deadline: float | None = None) -> tuple[int, bytearray]:
    """One frame: (kind, payload); ValueError for a payload over `limit` bytes (not one of ours).
    `closing` and `deadline` as in `_recv_exact`."""
    kind, size = _FRAME.unpack(_recv_exact(sock, _FRAME.size, closing, deadline))
    if size > limit:
        raise ValueError(f"a frame of {size} bytes, more than the {limit} allowed")
    return kind, _recv_exact(sock, size, closing, deadline)


def plan_secret(path: str | None) -> bytes:
    """The plan channel's shared secret: the contents of `path` (--plan-secret-file), else
    $JPAGED_PLAN_SECRET, without surrounding whitespace. ValueError naming both when neither is set
    or the secret is shorter than MIN_SECRET_BYTES; OSError naming the flag when the file cannot be read."""
    if path is not None:
        try:
            secret, source = Path(path).read_bytes().strip(), f"--plan-secret-file {path}"
        except OSError as exc:
            raise OSError(f"--plan-secret-file: cannot read {path}: {exc.strerror or exc}") from None
    elif SECRET_ENV in os.environ:
        secret, source = os.environ[SECRET_ENV].encode().strip(), f"${SECRET_ENV}"
    else:
        raise ValueError(f"a multi-process run needs the plan channel's shared secret, the same on every process: "
                         f"--plan-secret-file PATH or ${SECRET_ENV} (at least {MIN_SECRET_BYTES} bytes; e.g. "
                         f"python -c 'import secrets; print(secrets.token_hex(32))')")
    check_secret(secret, source)
    return secret


def check_secret(secret: bytes, source: str = "secret") -> None:
    """ValueError (naming `source`) unless `secret` is bytes of at least MIN_SECRET_BYTES."""
    if not isinstance(secret, bytes) or len(secret) < MIN_SECRET_BYTES:
        got = f"{len(secret)} bytes" if isinstance(secret, bytes) else type(secret).__name__
        raise ValueError(f"{source}: the plan secret must be at least {MIN_SECRET_BYTES} bytes, got {got}")


def derive(secret: bytes, label: bytes, leader_nonce: bytes, follower_nonce: bytes) -> bytes:
    """HMAC-SHA256 of one label and a connection's nonces (fixed sizes: the concatenation is unambiguous)."""
    return hmac.new(secret, label + leader_nonce + follower_nonce, hashlib.sha256).digest()


class Link:
    """One authenticated connection: every frame gets an HMAC-SHA256 tag over its direction's frame
    count, kind and payload. Senders serialise their sends (the count is part of the tag); one
    thread receives."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes):
        self.sock = sock
        self._send_key, self._recv_key = send_key, recv_key
        self._sent = self._received = 0

    def _tag(self, key: bytes, count: int, kind: int, buffers) -> bytes:
        mac = hmac.new(key, STEP.pack(count) + bytes([kind]), hashlib.sha256)
        for buffer in buffers:
            mac.update(buffer)
        return mac.digest()

    def send(self, kind: int, *buffers: bytes | memoryview) -> None:
        """One frame, tagged."""
        tag = self._tag(self._send_key, self._sent, kind, buffers)
        self._sent += 1
        send_frame(self.sock, kind, *buffers, tag)

    def recv(self, closing: threading.Event | None = None, limit: int = 2**30,
             deadline: float | None = None) -> tuple[int, bytearray]:
        """One frame whose tag checks out: (kind, payload); ConnectionError for one that does not
        (altered, injected, replayed or out of order). Arguments as in `recv_frame`."""
        kind, data = recv_frame(self.sock, closing, limit + TAG_BYTES, deadline)
        if len(data) < TAG_BYTES:
            raise ConnectionError(f"frame {self._received} has no authentication tag")
        tag = bytes(data[-TAG_BYTES:])
        del data[-TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(self._recv_key, self._received, kind, (data,))):
            raise ConnectionError(f"frame {self._received} failed its authentication check")
        self._received += 1
        return kind, data
