"""TCP wire format: the HMAC-SHA256 handshake and the frame header.

Handshake (fixed sizes, nothing is parsed beyond them before both sides have proved the secret)::

    client -> server  HELLO     48 B  magic "HPCD", version, role, pad, claimed rank, target id,
                                      32-byte client nonce
    server -> client  CHALLENGE 64 B  32-byte server nonce, HMAC(secret, "srv" | HELLO | nonce_s)
    client -> server  RESPONSE  32 B  HMAC(secret, "cli" | HELLO | nonce_s)
    server -> client  ACCEPT     4 B  "OK\\0\\0"

Fresh nonces on both sides make a replayed handshake fail; the role, the claimed rank and the
target are inside the MACs, so a handshake cannot be reused for another role or rank.
After it, every message is ``[HEADER][payload]`` with a 24-byte header whose length field is
checked against a cap before anything is allocated.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import struct
import time

from ..errors import AuthError, ProtocolError

__all__ = [
    "MAGIC", "HEADER", "ROLE_STORE", "ROLE_PEER", "client_handshake", "server_handshake",
    "recv_exact", "recv_into_exact", "pack_header", "unpack_header", "unpack_header_from", "max_frame",
    "handshake_timeout", "log_rejection", "get_secret", "LOG",
]

LOG = logging.getLogger("hpcdp.tcp")

MAGIC = b"HPCD"
VERSION = 1
ROLE_STORE = 1
ROLE_PEER = 2
STORE_ID = -1

_HELLO = struct.Struct("<4sBBHii32s")
HELLO_SIZE = _HELLO.size  # 48
NONCE = 32
MAC = 32
ACCEPT = b"OK\0\0"

#: kind, flags, pad, channel, tag, payload bytes
HEADER = struct.Struct("<BBHIqQ")

_unpack_from = HEADER.unpack_from

DEFAULT_MAX_FRAME = 1 << 30


def get_secret() -> bytes:
    """``HPCDP_SECRET`` as bytes; the TCP backend refuses to start without it."""
    raw = os.environ.get("HPCDP_SECRET", "")
    if not raw:
        from ..errors import BackendUnavailableError

        raise BackendUnavailableError(
            "tcp backend: HPCDP_SECRET is not set; every connection is authenticated with it. "
            "Launch with `hpcdp-run` or hpcdp.spawn (they generate one), or export the same "
            "random value on every rank, e.g. python -c 'import secrets; print(secrets.token_hex(32))'"
        )
    return raw.encode()


def max_frame() -> int:
    """Largest payload one frame may announce (``HPCDP_MAX_FRAME`` bytes; default 1 GiB)."""
    raw = os.environ.get("HPCDP_MAX_FRAME")
    return int(raw) if raw else DEFAULT_MAX_FRAME


def handshake_timeout() -> float:
    """Seconds a new connection may take to authenticate (``HPCDP_HANDSHAKE_TIMEOUT``, default 10)."""
    raw = os.environ.get("HPCDP_HANDSHAKE_TIMEOUT")
    return float(raw) if raw else 10.0


def log_rejection(addr: object, where: str, exc: BaseException) -> None:
    LOG.warning("hpcdp.tcp: dropped connection from %s at %s: %s: %s", addr, where,
                type(exc).__name__, exc)


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return buf


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely; EOF before that raises ``ConnectionError``."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def _mac(secret: bytes, label: bytes, hello: bytes, nonce_s: bytes) -> bytes:
    return hmac.new(secret, label + hello + nonce_s, hashlib.sha256).digest()


def _deadline_recv(sock: socket.socket, n: int, deadline: float) -> bytearray:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("handshake timed out")
    sock.settimeout(left)
    try:
        return recv_exact(sock, n)
    except socket.timeout:
        raise TimeoutError("handshake timed out (peer stayed silent)") from None


def client_handshake(sock: socket.socket, secret: bytes, role: int, my_id: int, target: int,
                     timeout: float) -> None:
    """Prove the secret to the server and check that the server knows it too."""
    deadline = time.monotonic() + timeout
    hello = _HELLO.pack(MAGIC, VERSION, role, 0, my_id, target, secrets.token_bytes(NONCE))
    sock.settimeout(timeout)
    sock.sendall(hello)
    chal = bytes(_deadline_recv(sock, NONCE + MAC, deadline))
    nonce_s, mac_s = chal[:NONCE], chal[NONCE:]
    if not hmac.compare_digest(mac_s, _mac(secret, b"srv", hello, nonce_s)):
        raise AuthError(f"handshake with {sock.getpeername()}: the server does not know the secret")
    sock.sendall(_mac(secret, b"cli", hello, nonce_s))
    if bytes(_deadline_recv(sock, len(ACCEPT), deadline)) != ACCEPT:
        raise AuthError(f"handshake with {sock.getpeername()}: not accepted")
    sock.settimeout(None)


def server_handshake(sock: socket.socket, secret: bytes, role: int, my_id: int,
                     timeout: float) -> int:
    """Authenticate a new connection; returns the id the client claimed (its rank, or -1)."""
    deadline = time.monotonic() + timeout
    hello = bytes(_deadline_recv(sock, HELLO_SIZE, deadline))
    magic, version, r, pad, claimed, target, _nonce = _HELLO.unpack(hello)
    if magic != MAGIC or version != VERSION or pad != 0:
        raise ProtocolError("malformed handshake (not an hpcdp peer)")
    if r != role or target != my_id:
        raise AuthError(f"handshake for role {r} target {target}; this endpoint is role {role} "
                        f"id {my_id}")
    nonce_s = secrets.token_bytes(NONCE)
    sock.sendall(nonce_s + _mac(secret, b"srv", hello, nonce_s))
    resp = bytes(_deadline_recv(sock, MAC, deadline))
    if not hmac.compare_digest(resp, _mac(secret, b"cli", hello, nonce_s)):
        raise AuthError("wrong HMAC in handshake response (bad secret or replayed handshake)")
    sock.sendall(ACCEPT)
    sock.settimeout(None)
    return claimed


def pack_header(kind: int, flags: int, channel: int, tag: int, nbytes: int) -> bytes:
    return HEADER.pack(kind, flags, 0, channel, tag, nbytes)


def unpack_header(raw: bytes | bytearray, kinds: frozenset[int], cap: int) -> tuple[int, int, int, int, int]:
    """(kind, flags, channel, tag, nbytes), or ``ProtocolError`` for anything unexpected."""
    return unpack_header_from(raw, 0, kinds, cap)


def unpack_header_from(buf: bytes | bytearray, pos: int, kinds: frozenset[int],
                       cap: int) -> tuple[int, int, int, int, int]:
    """``unpack_header`` of the header at ``buf[pos:]``."""
    kind, flags, pad, channel, tag, nbytes = _unpack_from(buf, pos)
    if kind not in kinds or pad != 0 or flags > 1:
        raise ProtocolError(f"malformed frame header (kind {kind}, flags {flags}, pad {pad})")
    if nbytes > cap:
        raise ProtocolError(f"frame of {nbytes} bytes exceeds the cap of {cap} bytes")
    return kind, flags, channel, tag, nbytes


def set_nodelay(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
