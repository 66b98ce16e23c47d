"""Rendezvous key-value store served by rank 0: ranks publish their addresses and wait for others.

Every connection authenticates first (``_tcp_wire``); requests are small frames (cap 1 MiB):
``SET key value`` and ``GET key timeout`` (which waits until the key exists or the timeout).
Values are bytes; nothing is unpickled.
"""
from __future__ import annotations

import socket
import struct
import threading
import time

from ..errors import CommTimeoutError, HpcdpError
from . import _tcp_wire as wire

__all__ = ["StoreServer", "StoreClient"]

SET, GET, VALUE, MISSING = 10, 11, 12, 13
_KINDS = frozenset({SET, GET, VALUE, MISSING})
STORE_CAP = 1 << 20
_KEYLEN = struct.Struct("<H")
_TIMEOUT = struct.Struct("<d")


class StoreServer:
    """A thread accepting authenticated clients; one short-lived thread per connection."""

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        self.secret = secret
        self.data: dict[bytes, bytes] = {}
        self.cv = threading.Condition()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(128)
        self.address = self.sock.getsockname()
        self._closed = False
        self._conns: set[socket.socket] = set()
        threading.Thread(target=self._accept_loop, name="hpcdp-store", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                             name="hpcdp-store-conn").start()

    def _serve(self, conn: socket.socket, addr: object) -> None:
        stage = "handshake"
        self._conns.add(conn)
        try:
            wire.server_handshake(conn, self.secret, wire.ROLE_STORE, wire.STORE_ID,
                                  wire.handshake_timeout())
            wire.set_nodelay(conn)
            stage = "request"
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
                    deadline = time.monotonic() + _TIMEOUT.unpack(rest)[0]
                    with self.cv:
                        while key not in self.data and not self._closed:
                            left = deadline - time.monotonic()
                            if left <= 0:
                                break
                            self.cv.wait(left)
                        val = self.data.get(key)
                    reply = (VALUE, val) if val is not None else (MISSING, b"")
                else:
                    raise wire.ProtocolError(f"unexpected store request kind {kind}")
                conn.sendall(wire.pack_header(reply[0], 0, 0, 0, len(reply[1])) + reply[1])
        except (OSError, HpcdpError, TimeoutError, struct.error) as exc:
            if not self._closed:
                wire.log_rejection(addr, f"store {stage}", exc)
        finally:
            self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closed = True
        with self.cv:
            self.cv.notify_all()
        try:
            self.sock.close()
        except OSError:
            pass
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class StoreClient:
    """A rank's connection to the store; connects with retries until ``timeout``."""

    def __init__(self, host: str, port: int, secret: bytes, rank: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
                wire.set_nodelay(sock)
                wire.client_handshake(sock, secret, wire.ROLE_STORE, rank, wire.STORE_ID,
                                      wire.handshake_timeout())
                break
            except (ConnectionRefusedError, ConnectionResetError, socket.timeout, TimeoutError) as exc:
                if time.monotonic() + delay > deadline:
                    raise CommTimeoutError(
                        f"tcp rendezvous (rank {rank}): no store at {host}:{port} after "
                        f"{timeout:g} s ({exc})") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
        self.sock = sock
        self.rank = rank
        self.lock = threading.Lock()

    def _request(self, kind: int, key: str, extra: bytes) -> tuple[int, bytes]:
        k = key.encode()
        body = _KEYLEN.pack(len(k)) + k + extra
        with self.lock:
            self.sock.sendall(wire.pack_header(kind, 0, 0, 0, len(body)) + body)
            raw = wire.recv_exact(self.sock, wire.HEADER.size)
            rkind, _f, _c, _t, n = wire.unpack_header(raw, _KINDS, STORE_CAP)
            return rkind, bytes(wire.recv_exact(self.sock, n))

    def set(self, key: str, value: bytes) -> None:
        self._request(SET, key, value)

    def get(self, key: str, timeout: float) -> bytes:
        """The value of ``key``, waiting up to ``timeout`` seconds for some rank to set it."""
        kind, val = self._request(GET, key, _TIMEOUT.pack(timeout))
        if kind != VALUE:
            raise CommTimeoutError(
                f"tcp rendezvous (rank {self.rank}): key {key!r} was not published within "
                f"{timeout:g} s (a rank did not start?)")
        return val

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
