"""Authenticated endpoints shared by the store and the rank-to-rank listener, and the client side.

``AuthListener`` owns a listening socket that faces the network and must let the job's ranks in
whatever else reaches its port. One thread runs every unauthenticated handshake at once
(non-blocking sockets, a selector), so a flood costs file descriptors, not threads:

- a new connection must deliver its whole HELLO within ``_wire.hello_timeout()`` (2 s; a
  real client sends it at once) and finish the handshake within ``handshake_timeout()``;
- at most ``PER_SOURCE`` connections from one address and ``MAX_PENDING_HANDSHAKES`` in all are
  unauthenticated at once; a newcomer beyond either cap evicts the oldest of its own address (or
  of the busiest address), so the newest connection always has a slot: slow or silent
  connections cannot keep out a rank, whose handshake takes one round trip;
- ``EMFILE``/``ECONNABORTED`` from ``accept`` are ridden out, and rejections are logged
  rate-limited, so a port scanner can flood neither the threads nor the log.

A connection reaches the owner's ``on_auth`` (on a thread of its own) only after the HMAC
handshake. ``connect`` is the other side: it retries refused, shed or timed-out attempts with
backoff until a deadline, so a listener under a flood delays a rank instead of failing it.
"""
from __future__ import annotations

import errno
import logging
import math
import selectors
import socket
import threading
import time
from typing import Callable

from ...errors import CommTimeoutError, HpcdpError
from . import _wire as wire

__all__ = ["AuthListener", "RejectionLog", "connect", "MAX_PENDING_HANDSHAKES", "PER_SOURCE"]

#: unauthenticated connections held at once per listener, and per source address
MAX_PENDING_HANDSHAKES = 256
PER_SOURCE = 64
#: new connections taken per turn of the loop, so pending handshakes are served in between
_ACCEPT_BURST = 8
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


class _Hand:
    """One unauthenticated connection: what has arrived, and when it must be done."""

    __slots__ = ("sock", "addr", "host", "buf", "got", "hello", "claimed", "nonce", "hello_by",
                 "done_by")

    def __init__(self, sock: socket.socket, addr: object, now: float) -> None:
        self.sock, self.addr = sock, addr
        self.host = addr[0] if isinstance(addr, tuple) else addr
        self.buf = bytearray(wire.HELLO_SIZE)
        self.got = 0
        self.hello: bytes | None = None  # set once the HELLO is in and checked
        self.claimed = 0
        self.nonce = b""
        self.hello_by = now + wire.hello_timeout()
        self.done_by = now + wire.handshake_timeout()


class AuthListener:
    """Accept connections on ``sock``; hand each to ``on_auth(conn, addr, claimed_id)`` on a thread
    of its own once it has authenticated for ``role``/``my_id``/``generation``.

    ``on_auth`` may keep the connection (return) or serve it to the end (then close it); an
    exception it raises is logged as a rejection at stage ``served`` and the connection closed.
    """

    def __init__(self, sock: socket.socket, secret: bytes, role: int, my_id: int, what: str,
                 on_auth: Callable[[socket.socket, object, int], None], *,
                 served: str = "after handshake", generation: int = 0) -> None:
        self.sock, self.secret, self.role, self.my_id = sock, secret, role, my_id
        self.what, self.served, self.on_auth = what, served, on_auth
        self.generation = generation
        self.closed = False
        #: connections in their handshake or in ``on_auth`` (shut down by ``close``)
        self.conns: set[socket.socket] = set()
        #: unauthenticated connections, oldest first, in all and per source address
        self.pending: dict[socket.socket, _Hand] = {}
        self.sources: dict[object, dict[socket.socket, _Hand]] = {}
        self.reject = RejectionLog(what)
        self._accept_errors = 0
        self._accept_logged = -math.inf
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, None)
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self.thread = threading.Thread(target=self._loop, name=f"hpcdp-accept {what}",
                                       daemon=True)
        self.thread.start()

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self.closed:
                wait = 0.5
                if self.pending:
                    now = time.monotonic()
                    wait = max(0.0, min(wait, min(self._due(h) for h in self.pending.values())
                                        - now))
                for key, _ in self._sel.select(wait):
                    if self.closed:
                        break
                    if key.data is None:
                        self._accept_some()
                    elif key.data == "wake":
                        return
                    else:
                        self._progress(key.data)
                self._expire()
        except OSError:
            if not self.closed:
                raise
        finally:
            for h in list(self.pending.values()):
                self._drop(h)
            self._sel.close()

    @staticmethod
    def _due(h: _Hand) -> float:
        return h.done_by if h.hello is not None else min(h.hello_by, h.done_by)

    def _accept_some(self) -> None:
        for _ in range(_ACCEPT_BURST):
            try:
                conn, addr = self.sock.accept()
            except BlockingIOError:
                return
            except OSError as exc:
                if self.closed or exc.errno in _CLOSED_ERRNOS:
                    self.closed = True  # the listening socket was closed or shut down
                    return
                self._accept_failed(exc)
                time.sleep(_ACCEPT_RETRY)  # EMFILE & co.: let handshakes time out, then go on
                return
            self._admit(conn, addr)

    def _admit(self, conn: socket.socket, addr: object) -> None:
        try:
            h = _Hand(conn, addr, time.monotonic())
        except HpcdpError as exc:  # a bad HPCDP_HANDSHAKE_TIMEOUT set after start: refuse
            conn.close()
            self.reject(addr, f"{self.what} accept", exc)
            return
        mine = self.sources.get(h.host)
        if mine is not None and len(mine) >= PER_SOURCE:
            self._evict(next(iter(mine.values())), f"more than {PER_SOURCE} unauthenticated "
                        "connections from this address")
        elif len(self.pending) >= MAX_PENDING_HANDSHAKES:
            busiest = max(self.sources.values(), key=len)
            self._evict(next(iter(busiest.values())), f"more than {MAX_PENDING_HANDSHAKES} "
                        "unauthenticated connections at once")
        try:
            conn.setblocking(False)
            self._sel.register(conn, selectors.EVENT_READ, h)
        except (OSError, ValueError) as exc:
            conn.close()
            self._accept_failed(exc)
            return
        self.pending[conn] = h
        self.sources.setdefault(h.host, {})[conn] = h
        self.conns.add(conn)

    def _progress(self, h: _Hand) -> None:
        """Read what ``h`` sent; advance its handshake one step when a piece is complete."""
        try:
            if h.hello is None:
                k = h.sock.recv_into(memoryview(h.buf)[h.got:])
            else:
                k = h.sock.recv_into(memoryview(h.buf)[h.got:wire.MAC])
            if k == 0:
                raise ConnectionError("connection closed by peer")
            h.got += k
            if h.hello is None and h.got == wire.HELLO_SIZE:
                raw = bytes(h.buf)
                h.claimed = wire.check_hello(raw, self.role, self.my_id, self.generation)
                h.nonce, chal = wire.challenge(self.secret, raw)
                if h.sock.send(chal) != len(chal):  # 64 bytes into an empty socket buffer
                    raise ConnectionError("could not send the challenge")
                h.hello, h.got = raw, 0
            elif h.hello is not None and h.got == wire.MAC:
                wire.check_response(self.secret, h.hello, h.nonce, bytes(h.buf[:wire.MAC]))
                h.sock.send(wire.ACCEPT)
                self._authenticated(h)
        except BlockingIOError:
            pass
        except Exception as exc:  # noqa: BLE001 - one bad client never kills the listener
            self._reject(h, exc)

    def _authenticated(self, h: _Hand) -> None:
        self._forget(h)
        h.sock.setblocking(True)
        try:
            threading.Thread(target=self._serve, args=(h.sock, h.addr, h.claimed), daemon=True,
                             name=f"hpcdp-conn {self.what}").start()
        except RuntimeError as exc:  # cannot start a thread: like EMFILE
            self.conns.discard(h.sock)
            h.sock.close()
            self._accept_failed(exc)

    def _serve(self, conn: socket.socket, addr: object, claimed: int) -> None:
        try:
            if not self.closed:
                self.on_auth(conn, addr, claimed)
        except Exception as exc:  # noqa: BLE001 - one bad client never kills the listener
            if not self.closed:
                self.reject(addr, f"{self.what} {self.served}", exc, authenticated=True)
            conn.close()
        finally:
            self.conns.discard(conn)

    def _expire(self) -> None:
        now = time.monotonic()
        for h in [h for h in self.pending.values() if self._due(h) <= now]:
            stage = "HELLO" if h.hello is None else "handshake"
            self._reject(h, TimeoutError(f"{stage} not complete in time "
                                         f"({h.got} bytes of it arrived)"))

    # -- dropping ---------------------------------------------------------------------------
    def _forget(self, h: _Hand) -> None:
        self.pending.pop(h.sock, None)
        mine = self.sources.get(h.host)
        if mine is not None:
            mine.pop(h.sock, None)
            if not mine:
                del self.sources[h.host]
        try:
            self._sel.unregister(h.sock)
        except (KeyError, ValueError, OSError):
            pass

    def _drop(self, h: _Hand) -> None:
        self._forget(h)
        self.conns.discard(h.sock)
        h.sock.close()

    def _reject(self, h: _Hand, exc: BaseException) -> None:
        """Log (rate-limited), then close: whoever sees the close finds the rejection counted."""
        if self.closed:
            pass
        elif isinstance(exc, wire.GenerationMismatch):
            # a newer generation is a re-init racing this (old) endpoint: it retries until the
            # new one is up; an older one will never match (ranks inited unequal times)
            newer = 0 < (exc.theirs - self.generation) % 65536 < 32768
            wire.LOG.log(logging.DEBUG if newer else logging.WARNING,
                         "hpcdp.tcp: %s: refused %s: %s", self.what, h.addr, exc)
        else:
            self.reject(h.addr, f"{self.what} handshake", exc)
        self._drop(h)

    def _evict(self, h: _Hand, why: str) -> None:
        self._reject(h, HpcdpError(f"{why}; the oldest was closed to make room"))

    def _accept_failed(self, exc: BaseException) -> None:
        self._accept_errors += 1
        now = time.monotonic()
        if now - self._accept_logged >= _LOG_WINDOW:
            wire.LOG.warning("hpcdp.tcp: %s: accept failed (%s: %s); %d failure(s) since the "
                             "last report; retrying", self.what, type(exc).__name__, exc,
                             self._accept_errors)
            self._accept_logged, self._accept_errors = now, 0

    def close(self) -> None:
        """Stop accepting; drop pending handshakes and shut down connections in ``on_auth``."""
        self.closed = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self.thread.join(2.0)
        for s in (self.sock, self._wake_r, self._wake_w):
            try:
                s.close()
            except OSError:
                pass
        for c in list(self.conns):
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.reject.flush()


def connect(host: str, port: int, secret: bytes, role: int, my_id: int, target: int,
            deadline: float, what: str, generation: int = 0) -> socket.socket:
    """An authenticated connection to ``host:port``, retried with backoff until ``deadline``
    (``time.monotonic()``); ``CommTimeoutError("{what} ...")`` when it cannot be had by then.

    Refused (not listening yet), closed or reset (the listener is shedding a burst of
    connections, or is the previous generation's) and timed-out attempts are retried; a failed
    authentication is not.
    """
    delay = 0.01
    while True:
        sock = None
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, min(
                deadline - time.monotonic(), wire.handshake_timeout())))
            wire.set_nodelay(sock)
            wire.client_handshake(sock, secret, role, my_id, target, wire.handshake_timeout(),
                                  generation)
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
