"""Authenticated endpoints shared by the store and the rank-to-rank listener, and the client side.

``AuthListener`` owns a listening socket that faces the network. It must survive whatever reaches
its port: the accept loop rides out ``EMFILE``/``ECONNABORTED``; at most
``MAX_PENDING_HANDSHAKES`` unauthenticated connections are served at once (the excess is closed
at once; real clients retry, see ``connect``); and rejections are logged rate-limited, so a port
scanner can neither exhaust threads nor flood the log. A connection reaches the owner's
``on_auth`` only after the HMAC handshake (``_tcp_wire``).

``connect`` is the other side: it retries refused, shed or timed-out attempts with backoff until
a deadline, so a listener that is busy shedding a flood delays a rank instead of failing it.
"""
from __future__ import annotations

import errno
import math
import socket
import threading
import time
from typing import Callable

from ..errors import CommTimeoutError, HpcdpError
from . import _tcp_wire as wire

__all__ = ["AuthListener", "RejectionLog", "connect", "MAX_PENDING_HANDSHAKES"]

#: unauthenticated connections served at once per listener; more are closed immediately
MAX_PENDING_HANDSHAKES = 64
#: rejection logging: one WARNING per peer host per window, at most _LOG_BURST per window
_LOG_WINDOW = 5.0
_LOG_BURST = 20
_ACCEPT_RETRY = 0.05
# accept() errors that mean the listening socket itself is gone
_CLOSED_ERRNOS = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK})


class RejectionLog:
    """Rate-limited ``log_rejection``: a single attacker is logged once per rejection, a flood is
    logged one WARNING per host per ``_LOG_WINDOW`` seconds plus a periodic count of the rest.

    Rejections of clients that passed the handshake are always logged: only holders of the
    secret can cause them (a misconfigured job), and a flood cannot.
    """

    def __init__(self, what: str) -> None:
        self.what = what
        self.lock = threading.Lock()
        self.last: dict[object, float] = {}
        self.window_start = time.monotonic()
        self.logged = 0
        self.suppressed = 0

    def __call__(self, addr: object, where: str, exc: BaseException,
                 authenticated: bool = False) -> None:
        if not authenticated:
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


class AuthListener:
    """Accept connections on ``sock``; hand each to ``on_auth(conn, addr, claimed_id)`` on a thread
    of its own once it has authenticated for ``role``/``my_id``.

    ``on_auth`` may keep the connection (return) or serve it to the end (then close it); an
    exception it raises is logged as a rejection at stage ``served`` and the connection closed.
    """

    def __init__(self, sock: socket.socket, secret: bytes, role: int, my_id: int, what: str,
                 on_auth: Callable[[socket.socket, object, int], None], *,
                 served: str = "after handshake") -> None:
        self.sock, self.secret, self.role, self.my_id = sock, secret, role, my_id
        self.what, self.served, self.on_auth = what, served, on_auth
        self.closed = False
        #: connections whose handshake or ``on_auth`` is running (shut down by ``close``)
        self.conns: set[socket.socket] = set()
        self.pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self.reject = RejectionLog(what)
        self._accept_errors = 0
        self._accept_logged = -math.inf
        self.thread = threading.Thread(target=self._accept_loop, name=f"hpcdp-accept {what}",
                                       daemon=True)
        self.thread.start()

    def _accept_loop(self) -> None:
        while not self.closed:
            try:
                conn, addr = self.sock.accept()
            except OSError as exc:
                if self.closed or exc.errno in _CLOSED_ERRNOS:
                    return  # the listening socket was closed or shut down
                self._accept_failed(exc)
                time.sleep(_ACCEPT_RETRY)  # EMFILE & co.: let handshakes time out, then go on
                continue
            if not self.pending.acquire(blocking=False):
                self.reject(addr, f"{self.what} accept",
                            HpcdpError(f"more than {MAX_PENDING_HANDSHAKES} unauthenticated "
                                       "connections at once; closed"))
                conn.close()
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                                 name=f"hpcdp-conn {self.what}").start()
            except RuntimeError as exc:  # cannot start a thread: treat like EMFILE
                self.pending.release()
                conn.close()
                self._accept_failed(exc)
                time.sleep(_ACCEPT_RETRY)

    def _accept_failed(self, exc: BaseException) -> None:
        self._accept_errors += 1
        now = time.monotonic()
        if now - self._accept_logged >= _LOG_WINDOW:
            wire.LOG.warning("hpcdp.tcp: %s: accept failed (%s: %s); %d failure(s) since the "
                             "last report; retrying", self.what, type(exc).__name__, exc,
                             self._accept_errors)
            self._accept_logged, self._accept_errors = now, 0

    def _serve(self, conn: socket.socket, addr: object) -> None:
        pending = True
        self.conns.add(conn)
        try:
            if self.closed:
                conn.close()
                return
            claimed = wire.server_handshake(conn, self.secret, self.role, self.my_id,
                                            wire.handshake_timeout())
            self.pending.release()
            pending = False
            self.on_auth(conn, addr, claimed)
        except Exception as exc:  # noqa: BLE001 - one bad client never kills the listener
            if not self.closed:
                self.reject(addr, f"{self.what} {'handshake' if pending else self.served}", exc,
                            authenticated=not pending)
            conn.close()
        finally:
            if pending:
                self.pending.release()
            self.conns.discard(conn)

    def close(self) -> None:
        """Stop accepting and shut down connections still in their handshake or ``on_auth``."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() on Linux
        except OSError:
            pass
        try:
            self.sock.close()
        except OSError:
            pass
        for c in list(self.conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.reject.flush()


def connect(host: str, port: int, secret: bytes, role: int, my_id: int, target: int,
            deadline: float, what: str) -> socket.socket:
    """An authenticated connection to ``host:port``, retried with backoff until ``deadline``
    (``time.monotonic()``); ``CommTimeoutError("{what} ...")`` when it cannot be had by then.

    Refused (not listening yet), closed or reset (the listener is shedding a burst of
    connections) and timed-out attempts are retried; a failed authentication is not.
    """
    delay = 0.01
    while True:
        sock = None
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, min(
                deadline - time.monotonic(), wire.handshake_timeout())))
            wire.set_nodelay(sock)
            wire.client_handshake(sock, secret, role, my_id, target, wire.handshake_timeout())
            return sock
        except (ConnectionError, socket.timeout, TimeoutError) as exc:
            if sock is not None:
                sock.close()
            if time.monotonic() + delay > deadline:
                raise CommTimeoutError(f"{what} ({exc})") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        except BaseException:
            if sock is not None:
                sock.close()
            raise
