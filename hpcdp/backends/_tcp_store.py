"""Rendezvous key-value store served by rank 0: ranks publish their addresses and wait for others.

Every connection authenticates first (``_tcp_wire``); requests are small frames (cap 1 MiB):
``SET key value`` and ``GET key timeout`` (which waits until the key exists or the timeout).
Values are bytes; nothing is unpickled.

The store must survive whatever reaches its port before the job starts: the accept loop rides
out ``EMFILE``/``ECONNABORTED``, at most ``MAX_PENDING_HANDSHAKES`` unauthenticated connections
are served at once (the excess is closed at once; real ranks retry), and rejections are logged
rate-limited so a port scanner cannot flood the log. Clients put a deadline on every request,
so a store whose node vanished (no RST) is an error, not a hang.
"""
from __future__ import annotations

import errno
import math
import socket
import struct
import threading
import time

from ..errors import CommTimeoutError, HpcdpError, PeerFailureError
from . import _tcp_wire as wire

__all__ = ["StoreServer", "StoreClient"]

SET, GET, VALUE, MISSING = 10, 11, 12, 13
_KINDS = frozenset({SET, GET, VALUE, MISSING})
STORE_CAP = 1 << 20
_KEYLEN = struct.Struct("<H")
_TIMEOUT = struct.Struct("<d")

#: unauthenticated connections served at once; more are closed immediately
MAX_PENDING_HANDSHAKES = 64
#: longest single wait a GET asks of the server; longer waits are several requests
MAX_WAIT = 30.0
#: rejection logging: one WARNING per peer host per window, at most _LOG_BURST per window
_LOG_WINDOW = 5.0
_LOG_BURST = 20
_ACCEPT_RETRY = 0.05
# accept() errors that mean the listening socket itself is gone
_CLOSED_ERRNOS = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})


def _wait_seconds(timeout: float) -> float:
    """A GET wait as the server may honour it: NaN or negative is 0, at most ``MAX_WAIT``."""
    if not timeout > 0:  # also NaN
        return 0.0
    return min(float(timeout), MAX_WAIT)


class _RejectionLog:
    """Rate-limited ``log_rejection``: a single attacker is logged once per rejection, a flood is
    logged one WARNING per host per ``_LOG_WINDOW`` seconds plus a periodic count of the rest."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.lock = threading.Lock()
        self.last: dict[object, float] = {}
        self.window_start = time.monotonic()
        self.logged = 0
        self.suppressed = 0

    def __call__(self, addr: object, where: str, exc: BaseException) -> None:
        host = addr[0] if isinstance(addr, tuple) and addr else addr
        now = time.monotonic()
        with self.lock:
            if now - self.window_start >= _LOG_WINDOW:
                self._flush(now)
            t = self.last.get(host)
            if (t is not None and now - t < _LOG_WINDOW) or self.logged >= _LOG_BURST:
                self.suppressed += 1
                return
            self.logged += 1
            if len(self.last) > 4096:
                self.last = {h: s for h, s in self.last.items() if now - s < _LOG_WINDOW}
            self.last[host] = now
        wire.log_rejection(addr, where, exc)

    def _flush(self, now: float) -> None:
        if self.suppressed:
            wire.LOG.warning("hpcdp.tcp: %s: %d more connection(s) rejected in the last %.0f s "
                             "(not logged individually)", self.what, self.suppressed,
                             now - self.window_start)
        self.window_start, self.logged, self.suppressed = now, 0, 0

    def flush(self) -> None:
        with self.lock:
            self._flush(time.monotonic())


class StoreServer:
    """A thread accepting authenticated clients; one thread per connection."""

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
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._reject = _RejectionLog(f"store {self.address[0]}:{self.address[1]}")
        self._accept_errors = 0
        self._accept_logged = -math.inf
        threading.Thread(target=self._accept_loop, name="hpcdp-store", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self.sock.accept()
            except OSError as exc:
                if self._closed or exc.errno in _CLOSED_ERRNOS:
                    return  # the listening socket was closed or shut down
                self._accept_failed(exc)
                time.sleep(_ACCEPT_RETRY)  # EMFILE & co.: let handshakes time out, then go on
                continue
            if not self._pending.acquire(blocking=False):
                self._reject(addr, "store accept",
                             HpcdpError(f"more than {MAX_PENDING_HANDSHAKES} unauthenticated "
                                        "connections at once; closed"))
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                                 name="hpcdp-store-conn").start()
            except RuntimeError as exc:  # cannot start a thread: treat like EMFILE
                self._pending.release()
                conn.close()
                self._accept_failed(exc)
                time.sleep(_ACCEPT_RETRY)

    def _accept_failed(self, exc: BaseException) -> None:
        self._accept_errors += 1
        now = time.monotonic()
        if now - self._accept_logged >= _LOG_WINDOW:
            wire.LOG.warning("hpcdp.tcp: store %s:%s: accept failed (%s: %s); %d failure(s) since "
                             "the last report; retrying", self.address[0], self.address[1],
                             type(exc).__name__, exc, self._accept_errors)
            self._accept_logged, self._accept_errors = now, 0

    def _serve(self, conn: socket.socket, addr: object) -> None:
        stage = "handshake"
        pending = True
        self._conns.add(conn)
        try:
            if self._closed:
                return
            wire.server_handshake(conn, self.secret, wire.ROLE_STORE, wire.STORE_ID,
                                  wire.handshake_timeout())
            self._pending.release()
            pending = False
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
        except Exception as exc:  # noqa: BLE001 - one bad client never kills the store
            if not self._closed:
                self._reject(addr, f"store {stage}", exc)
        finally:
            if pending:
                self._pending.release()
            self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._closed = True
        with self.cv:
            self.cv.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        for c in list(self._conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._reject.flush()


class StoreClient:
    """A rank's connection to the store; connects with retries until ``timeout``.

    Every request has a deadline (its wait plus a margin of ``timeout``, at most 30 s), so a
    store that vanished without a reset raises ``CommTimeoutError`` instead of hanging.
    """

    def __init__(self, host: str, port: int, secret: bytes, rank: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            sock = None
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, min(
                    deadline - time.monotonic(), wire.handshake_timeout())))
                wire.set_nodelay(sock)
                wire.client_handshake(sock, secret, wire.ROLE_STORE, rank, wire.STORE_ID,
                                      wire.handshake_timeout())
                break
            except (ConnectionError, socket.timeout, TimeoutError) as exc:
                # refused (not up yet), or closed/reset (the store is shedding a burst of
                # connections): try again until the rendezvous deadline
                if sock is not None:
                    sock.close()
                if time.monotonic() + delay > deadline:
                    raise CommTimeoutError(
                        f"tcp rendezvous (rank {rank}): no store at {host}:{port} after "
                        f"{timeout:g} s ({exc})") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except BaseException:
                if sock is not None:
                    sock.close()
                raise
        self.sock = sock
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
