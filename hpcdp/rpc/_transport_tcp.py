"""Ranks in separate processes without an MPI communicator (TCP, or any such backend): RPC's own
full mesh of authenticated connections.

Built collectively after the world exists: each rank listens (the same HMAC gate as the TCP
world's listener, ``backends.tcp._accept.AuthListener``, for a role of its own so a handshake
cannot be replayed across roles), publishes ``host:port`` through the group, connects to every
higher rank and accepts every lower one.

Sending: a frame's small parts go out as one buffer and its arrays straight from their memory
(``sendmsg``, zero-copy), under a per-peer lock, first without blocking; a send that would block
hands a serving duty off first (``_duty``), and a peer that stops reading for ``send_timeout``
seconds is failed instead of blocking the sender forever.

Reading (``_stream.FrameReader``, resumable at any byte) is done by whichever thread holds the
peer's read token: a caller waiting for a reply from that peer reads the socket itself (its
reply then needs no hand-off between threads), otherwise the peer's background reader, which
stays parked while a caller reads and for a short linger after (so a ping-pong does not wake
it). The background reader holds the peer's serving duty: it runs short callees itself and,
when one runs long or blocks, a new reader thread takes over the socket.
"""
from __future__ import annotations

import functools
import logging
import os
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Sequence

from .._config import setting
from ..backends.tcp import _wire as tcpwire
from ..backends.tcp import bind_address
from ..backends.tcp._accept import AuthListener, connect
from ..errors import CommTimeoutError, HpcdpError, PeerFailureError, ProtocolError
from ._codec import Limits
from ._duty import before_blocking
from ._stream import FrameReader
from ._transport_base import BYE, Deliver, Lost, Transport, exchange_bytes
from ._wire import pack_envelope, pack_prefix

__all__ = ["TCPTransport", "ROLE_RPC"]

LOG = logging.getLogger("hpcdp.rpc")

#: handshake role of RPC connections (the store is 1, the world's mesh 2)
ROLE_RPC = 3
_IOV = 512
#: frame parts up to this size are joined into one buffer (one copy, one iovec)
_JOIN = 64 << 10
#: after a caller's read the background reader stays parked this long unless kicked
LINGER = 0.002
_BYE_ENV = pack_envelope([BYE, 0])
_DONTWAIT = getattr(socket, "MSG_DONTWAIT", 0)
_POLLIN = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
_monotonic = time.monotonic


class _Peer:
    __slots__ = ("rank", "sock", "wlock", "rlock", "reader", "bgcv", "gen", "thread", "parked",
                 "linger_until", "said_bye", "dead", "stopped", "bg_poll", "direct_poll",
                 "direct")

    def __init__(self, rank: int, sock: socket.socket, limits: Limits) -> None:
        self.rank, self.sock = rank, sock
        self.wlock = threading.Lock()
        self.rlock = threading.Lock()  # the read token: whoever holds it advances ``reader``
        self.reader = FrameReader(limits)
        self.bgcv = threading.Condition()
        self.gen = 0  # which background reader serves the peer (a new one after a hand-off)
        self.thread: threading.Thread | None = None
        self.parked = False
        self.linger_until = 0.0
        self.said_bye = False
        self.dead: str | None = None
        self.stopped = False
        # one poll object per role: a poll object must not be used by two threads at once
        self.bg_poll = select.poll()
        self.bg_poll.register(sock, _POLLIN)
        self.direct_poll = select.poll()
        self.direct_poll.register(sock, _POLLIN)
        self.direct: Callable[[Any, float], None] | None = None


class TCPTransport(Transport):
    name = "tcp"

    def __init__(self, group: Any, limits: Limits, deliver: Deliver, lost: Lost,
                 timeout: float, send_timeout: float) -> None:
        super().__init__(group.rank, group.size, limits, deliver, lost)
        self.secret = tcpwire.get_secret()
        self.send_timeout = send_timeout
        self.peers: dict[int, _Peer] = {}
        self.closing = False
        self.started = False
        self._cv = threading.Condition()
        self._expected = set(range(self.rank))
        master = setting("HPCDP_MASTER_ADDR") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        host = bind_address(master)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.bind((host, 0))
        self.listener.listen(max(64, self.size))
        self.address = self.listener.getsockname()
        self.acceptor = AuthListener(self.listener, self.secret, ROLE_RPC, self.rank,
                                     f"rank {self.rank} rpc listener", self._admit,
                                     served="rpc admission")
        try:
            self._connect_mesh(group, timeout)
        except BaseException:
            self.close(False, 0.0)
            raise

    def _connect_mesh(self, group: Any, timeout: float) -> None:
        addrs = exchange_bytes(group, f"{self.address[0]}:{self.address[1]}".encode(), timeout)
        deadline = time.monotonic() + timeout
        for peer in range(self.rank + 1, self.size):
            h, p = addrs[peer].decode().rsplit(":", 1)
            sock = connect(h, int(p), self.secret, ROLE_RPC, self.rank, peer, deadline,
                           f"init_rpc (rank {self.rank}): cannot reach rank {peer}'s RPC listener "
                           f"at {h}:{p} within {timeout:g} s")
            self._add(peer, sock)
        with self._cv:
            while self._expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CommTimeoutError(f"init_rpc (rank {self.rank}): ranks "
                                           f"{sorted(self._expected)} did not connect to the RPC "
                                           f"listener within {timeout:g} s")
                self._cv.wait(left)

    def _admit(self, conn: socket.socket, _addr: object, claimed: int) -> None:
        """An authenticated lower rank joins, once; anything else is refused (and logged)."""
        with self._cv:
            if self.closing or claimed not in self._expected:
                raise ProtocolError(f"rpc listener of rank {self.rank}: unexpected connection "
                                    f"claiming rank {claimed} (no free slot for it)")
            self._expected.discard(claimed)
            self._add(claimed, conn)
            self._cv.notify_all()

    def _add(self, rank: int, sock: socket.socket) -> None:
        tcpwire.set_nodelay(sock)
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(self.send_timeout),
                                    int((self.send_timeout % 1) * 1e6)))
        peer = _Peer(rank, sock, self.limits)
        peer.direct = functools.partial(self._direct_wait, peer)
        peer.thread = self._reader_thread(peer)
        self.peers[rank] = peer
        if self.started:
            peer.thread.start()

    def _reader_thread(self, peer: _Peer) -> threading.Thread:
        return threading.Thread(target=self._serve, args=(peer, peer.gen), daemon=True,
                                name=f"hpcdp-rpc-tcp{self.rank}<-{peer.rank}.{peer.gen}")

    def start(self) -> None:
        with self._cv:
            self.started = True
            for p in self.peers.values():
                p.thread.start()

    def direct(self, dst: int) -> Callable[[Any, float], None] | None:
        peer = self.peers.get(dst)
        return None if peer is None else peer.direct

    # -- sending ---------------------------------------------------------------------------
    def send(self, dst: int, env: bytes, body: bytes, buffers: Sequence[memoryview]) -> None:
        peer = self.peers.get(dst)
        if peer is None or peer.dead is not None:
            why = peer.dead if peer is not None else "not connected"
            raise PeerFailureError(f"rpc send from rank {self.rank} to rank {dst}: {why}",
                                   peers=[dst])
        prefix = pack_prefix(env, body, [b.nbytes for b in buffers])
        if len(body) <= _JOIN:
            parts: list[Any] = [prefix + env + body]
        else:
            parts = [prefix + env, memoryview(body)]
        parts.extend(b for b in buffers if b.nbytes)
        with peer.wlock:
            if peer.dead is not None:
                raise PeerFailureError(f"rpc send from rank {self.rank} to rank {dst}: "
                                       f"{peer.dead}", peers=[dst])
            try:
                _send_parts(peer.sock, parts)
            except OSError as exc:
                why = ("it stopped reading for "
                       f"{self.send_timeout:g} s" if isinstance(exc, BlockingIOError) else
                       f"{type(exc).__name__}: {exc}")
                self._fail(peer, f"send failed ({why})")
                raise PeerFailureError(f"rpc send from rank {self.rank} to rank {dst}: {why}",
                                       peers=[dst]) from None

    def _fail(self, peer: _Peer, why: str) -> None:
        if peer.dead is None:
            peer.dead = why
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)  # the reader sees it and reports the loss
            except OSError:
                pass

    # -- reading ---------------------------------------------------------------------------
    def _frames(self, peer: _Peer, may_inline: bool, more: Callable[[], bool]) -> Any:
        """Deliver the frames that have arrived (the caller holds ``peer.rlock``); stop at an
        inline task (returned, to be run once the token is released) or when ``more()`` says."""
        reader, sock = peer.reader, peer.sock
        try:
            while not peer.stopped:
                frame = reader.next_frame()
                if frame is None:
                    # the background reader waits for the rest of a large part in recv()
                    if not more() or not reader.recv(sock, may_inline):
                        return None
                    continue
                if frame.env == _BYE_ENV and frame.body == b"" and not frame.buffers:
                    peer.said_bye = True
                    continue
                task = self.deliver(peer.rank, frame, may_inline)
                if task is not None:
                    return task
        except Exception as exc:  # noqa: BLE001 - the stream cannot be followed any further
            if not isinstance(exc, (OSError, HpcdpError, struct.error)):
                LOG.exception("hpcdp.rpc: rank %d: reading from rank %d failed", self.rank,
                              peer.rank)
            self._ended(peer, exc)
        return None

    def _ended(self, peer: _Peer, exc: BaseException) -> None:
        """The stream from ``peer`` ended or broke (the caller holds ``peer.rlock``)."""
        if peer.stopped:
            return
        peer.stopped = True
        graceful = isinstance(exc, ConnectionError) and peer.said_bye
        if graceful:
            why = "it shut down"
        elif isinstance(exc, ConnectionError):
            why = "connection closed by the peer"
        else:
            why = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ProtocolError):
                LOG.warning("hpcdp.rpc: rank %d dropped its connection from rank %d: %s",
                            self.rank, peer.rank, exc)
        if peer.dead is None:
            peer.dead = why
        try:
            peer.sock.shutdown(socket.SHUT_RDWR)  # closed in close(): no fd reuse under a sender
        except OSError:
            pass
        with peer.bgcv:
            peer.bgcv.notify_all()
        if not self.closing:
            self.lost(peer.rank, why, graceful)

    def _serve(self, peer: _Peer, gen: int) -> None:
        """A peer's background reader (its serving duty): reads while no caller does."""
        rlock, bgcv, poll = peer.rlock, peer.bgcv, peer.bg_poll.poll
        backoff = LINGER
        handoff = functools.partial(self._replace, peer, gen)

        def more() -> bool:
            return peer.gen == gen and peer.linger_until <= _monotonic()

        # complete frames may be staged already: for a new reader (a hand-off), and after an
        # inline task (frames read with its request wait); otherwise only a partial one is
        parse = True
        try:
            while not peer.stopped and peer.gen == gen:
                with bgcv:
                    left = peer.linger_until - _monotonic()
                    if left > 0 or rlock.locked():
                        # a caller reads (or just did): stay out of its way, waking rarely
                        peer.parked = True
                        bgcv.wait(max(left, backoff))
                        peer.parked = False
                        backoff = min(2 * backoff, 0.01)
                        parse = True  # the caller may have staged frames it did not want
                        continue
                backoff = LINGER
                if not parse and not poll(200):
                    continue
                if not rlock.acquire(False):
                    continue
                try:
                    task = self._frames(peer, True, more)
                finally:
                    rlock.release()
                parse = task is not None
                if task is not None:
                    task.run(handoff)
        except Exception:  # noqa: BLE001 - a bug must not end the reading silently
            LOG.exception("hpcdp.rpc: rank %d: reader of rank %d failed", self.rank, peer.rank)

    def _replace(self, peer: _Peer, gen: int) -> None:
        """Hand the serving duty to a new reader thread (this one's callee runs long)."""
        with peer.bgcv:
            if peer.gen != gen or peer.stopped or self.closing:
                return
            peer.gen += 1
            t = peer.thread = self._reader_thread(peer)
        t.start()

    def _kick(self, peer: _Peer) -> None:
        with peer.bgcv:
            peer.linger_until = 0.0
            if peer.parked:
                peer.bgcv.notify_all()

    def _direct_wait(self, peer: _Peer, fut: Any, until: float) -> None:
        """Read ``peer``'s socket on this thread until ``fut`` completes or ``until``."""
        if peer.stopped or not peer.rlock.acquire(False):
            return  # another thread reads: it delivers our reply
        t0 = _monotonic()
        poll = peer.direct_poll.poll

        def more() -> bool:
            return not fut.done()

        try:
            while not fut.done() and not peer.stopped:
                self._frames(peer, False, more)
                if fut.done() or peer.stopped:
                    break
                left = until - _monotonic()
                if left <= 0:
                    break
                poll(max(1, int(left * 1000)))
        finally:
            t1 = _monotonic()
            # a long wait (not a ping-pong), or more from the peer than our reply: the
            # background reader takes over now rather than after its linger
            more_came = peer.reader.buffered() or bool(poll(0))
            if more_came or t1 - t0 > LINGER:
                peer.rlock.release()
                self._kick(peer)
            else:
                peer.linger_until = t1 + LINGER
                peer.rlock.release()

    # -- closing ---------------------------------------------------------------------------
    def close(self, graceful: bool, timeout: float) -> None:
        with self._cv:
            if self.closing:
                return
            self.closing = True
        self.acceptor.close()
        peers = list(self.peers.values())
        if graceful:
            for p in peers:
                try:
                    with p.wlock:
                        if p.dead is None:
                            p.sock.sendall(pack_prefix(_BYE_ENV, b"", []) + _BYE_ENV)
                            p.sock.shutdown(socket.SHUT_WR)  # the peer reads to our EOF
                except OSError:
                    pass
            deadline = time.monotonic() + timeout
            for p in peers:  # each reader ends at the peer's EOF (it closes after BYE too)
                t = p.thread
                if t is not None and t.ident is not None and t is not threading.current_thread():
                    t.join(max(0.0, deadline - time.monotonic()))
        for p in peers:
            p.stopped = True
            try:
                p.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            with p.bgcv:
                p.bgcv.notify_all()
        for p in peers:
            t = p.thread
            if t is not None and t.ident is not None and t is not threading.current_thread():
                t.join(0.5)  # out of poll() before its descriptor goes
            try:
                p.sock.close()
            except OSError:
                pass


def _send_parts(sock: socket.socket, parts: list[Any]) -> None:
    """Write every part: first without blocking; if the socket is full, hand a serving duty
    off (``before_blocking``) and go on blocking (bounded by ``SO_SNDTIMEO``)."""
    flags = _DONTWAIT
    i = 0
    while i < len(parts):
        try:
            if flags and len(parts) - i == 1:
                n = sock.send(parts[i], flags)
            else:
                n = sock.sendmsg(parts[i:i + _IOV], [], flags)
        except (BlockingIOError, InterruptedError):
            if not flags:
                raise
            n = 0
        while n and i < len(parts):
            k = len(parts[i]) if isinstance(parts[i], bytes) else parts[i].nbytes
            if n >= k:
                n -= k
                i += 1
            else:
                parts[i] = memoryview(parts[i])[n:]
                n = 0
        if i < len(parts) and flags:
            flags = 0
            before_blocking()
