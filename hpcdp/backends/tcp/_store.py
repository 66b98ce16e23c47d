"""Rendezvous key-value store served by rank 0: ranks publish their addresses and wait for others.

Every connection authenticates first (``_wire``); requests are small frames (cap 1 MiB):
``SET key value`` and ``GET key timeout`` (which waits until the key exists or the timeout).
Values are bytes; nothing is unpickled.

The store must survive whatever reaches its port before the job starts; ``_accept`` (shared
with the rank-to-rank listener) runs every unauthenticated handshake on one thread with short
deadlines and per-address caps that always leave a new connection a slot, rides out ``EMFILE``
and rate-limits the rejection log, and clients retry while it sheds a flood. Keys are prefixed
with the init generation by ``tcp._World``, and the handshake checks it. Clients put a deadline on every request, so a store whose node vanished (no RST) is an
error, not a hang.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

from ...errors import CommTimeoutError, HpcdpError, PeerFailureError
from . import _wire as wire
from ._accept import MAX_PENDING_HANDSHAKES, AuthListener, connect

__all__ = ["StoreServer", "StoreClient", "MAX_PENDING_HANDSHAKES"]

SET, GET, VALUE, MISSING = 10, 11, 12, 13
_KINDS = frozenset({SET, GET, VALUE, MISSING})
STORE_CAP = 1 << 20
_KEYLEN = struct.Struct("<H")
_TIMEOUT = struct.Struct("<d")

#: longest single wait a GET asks of the server; longer waits are several requests
MAX_WAIT = 30.0


def _wait_seconds(timeout: float) -> float:
    """A GET wait as the server may honour it: NaN or negative is 0, at most ``MAX_WAIT``."""
    if not timeout > 0:  # also NaN
        return 0.0
    return min(float(timeout), MAX_WAIT)


class StoreServer:
    """Serves authenticated clients, one thread per connection (``_accept.AuthListener``)."""

    def __init__(self, host: str, port: int, secret: bytes, *, generation: int = 0) -> None:
        self.data: dict[bytes, bytes] = {}
        self.cv = threading.Condition()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.address = self.sock.getsockname()
        self._closed = False
        self._listener = AuthListener(self.sock, secret, wire.ROLE_STORE, wire.STORE_ID,
                                      f"store {self.address[0]}:{self.address[1]}", self._serve,
                                      served="request", generation=generation)
        self._conns = self._listener.conns

    def _serve(self, conn: socket.socket, _addr: object, _claimed: int) -> None:
        try:
            wire.set_nodelay(conn)
            while not self._closed:
                try:
                    raw = wire.recv_exact(conn, wire.HEADER.size)
                except ConnectionError:
                    return  # a client that is done
                kind, _f, _c, _t, n = wire.unpack_header(raw, _KINDS, STORE_CAP)
                body = bytes(wire.recv_exact(conn, n))
                (klen,) = _KEYLEN.unpack_from(body)
                key, rest = body[2:2 + klen], body[2 + klen:]
                if kind == SET:
                    with self.cv:
                        self.data[key] = rest
                        self.cv.notify_all()
                    reply = (VALUE, b"")
                elif kind == GET and len(rest) == _TIMEOUT.size:
                    deadline = time.monotonic() + _wait_seconds(_TIMEOUT.unpack(rest)[0])
                    with self.cv:
                        while key not in self.data and not self._closed:
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break
                            self.cv.wait(left)
                        val = self.data.get(key)
                    if val is None and self._closed:
                        return  # shutting down: the client sees the connection drop
                    reply = (VALUE, val) if val is not None else (MISSING, b"")
                else:
                    raise wire.ProtocolError(f"unexpected store request kind {kind}")
                conn.sendall(wire.pack_header(reply[0], 0, 0, 0, len(reply[1])) + reply[1])
        finally:
            conn.close()

    def close(self) -> None:
        self._closed = True
        with self.cv:
            self.cv.notify_all()
        self._listener.close()


class StoreClient:
    """A rank's connection to the store; connects with retries until ``timeout``.

    Every request has a deadline (its wait plus a margin of ``timeout``, at most 30 s), so a
    store that vanished without a reset raises ``CommTimeoutError`` instead of hanging.
    """

    def __init__(self, host: str, port: int, secret: bytes, rank: int, timeout: float, *,
                 generation: int = 0) -> None:
        self.sock = connect(host, port, secret, wire.ROLE_STORE, rank, wire.STORE_ID,
                            time.monotonic() + timeout,
                            f"tcp rendezvous (rank {rank}): no store at {host}:{port} after "
                            f"{timeout:g} s", generation=generation)
        self.host, self.port = host, port
        self.rank = rank
        self.margin = min(max(timeout, 1.0), 30.0) if timeout == timeout else 30.0
        self.lock = threading.Lock()
        self._broken: str | None = None

    def _request(self, kind: int, key: str, extra: bytes, wait: float) -> tuple[int, bytes]:
        k = key.encode()
        body = _KEYLEN.pack(len(k)) + k + extra
        what = f"{'SET' if kind == SET else 'GET'} {key!r}"
        where = f"tcp rendezvous (rank {self.rank}): store at {self.host}:{self.port}"
        limit = wait + self.margin
        with self.lock:
            if self._broken is not None:
                raise PeerFailureError(f"{where}: connection unusable after an earlier error "
                                       f"({self._broken}); cannot {what}", peers=(0,))
            try:
                self.sock.settimeout(limit)
                self.sock.sendall(wire.pack_header(kind, 0, 0, 0, len(body)) + body)
                raw = wire.recv_exact(self.sock, wire.HEADER.size)
                rkind, _f, _c, _t, n = wire.unpack_header(raw, _KINDS, STORE_CAP)
                return rkind, bytes(wire.recv_exact(self.sock, n))
            except (socket.timeout, TimeoutError):
                self._broken = "timed out"
                self._close_sock()
                raise CommTimeoutError(
                    f"{where} did not answer {what} within {limit:g} s (rank 0 or its node "
                    f"is gone?)") from None
            except (OSError, HpcdpError) as exc:
                self._broken = f"{type(exc).__name__}: {exc}"
                self._close_sock()
                raise PeerFailureError(f"{where}: lost the connection during {what} "
                                       f"({type(exc).__name__}: {exc}); rank 0 failed?",
                                       peers=(0,)) from exc

    def set(self, key: str, value: bytes) -> None:
        self._request(SET, key, value, 0.0)

    def get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds (may be ``inf``) for some rank
        to set it. Long waits are split into requests of at most ``MAX_WAIT`` seconds."""
        total = float(timeout) if timeout > 0 else 0.0  # NaN or negative: just look
        deadline = time.monotonic() + total
        while True:
            left = max(0.0, deadline - time.monotonic())
            wait = min(left, MAX_WAIT)
            kind, val = self._request(GET, key, _TIMEOUT.pack(wait), wait)
            if kind == VALUE:
                return val
            if kind != MISSING:
                raise PeerFailureError(f"tcp rendezvous (rank {self.rank}): store at "
                                       f"{self.host}:{self.port} answered GET {key!r} with frame "
                                       f"kind {kind}", peers=(0,))
            if wait >= left or time.monotonic() >= deadline:
                raise CommTimeoutError(
                    f"tcp rendezvous (rank {self.rank}): key {key!r} was not published within "
                    f"{timeout:g} s (a rank did not start?)")

    def _close_sock(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def close(self) -> None:
        self._close_sock()
