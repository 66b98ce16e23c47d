"""TCP ranks: RPC's own full mesh of authenticated connections, one reader thread per peer.

Built collectively after the TCP world exists: each rank listens (the same HMAC gate as the
world's listener, ``_tcp_accept.AuthListener``, for a role of its own so a handshake cannot be
replayed across roles), publishes ``host:port`` through the group, connects to every higher
rank and accepts every lower one. Senders write whole frames with ``sendmsg`` straight from the
array buffers (zero-copy) under a per-peer lock; a peer that stops reading for ``send_timeout``
seconds is failed instead of blocking the sender forever. Readers allocate only what the prefix
announced and the limits allow; an over-limit frame is drained in fixed chunks.
"""
from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from typing import Any, Sequence

import numpy as np

from ..backends import _tcp_wire as tcpwire
from ..backends._tcp_accept import AuthListener, connect
from ..backends.tcp import bind_address
from ..errors import CommTimeoutError, HpcdpError, PeerFailureError, ProtocolError
from ._codec import Limits
from ._transport_base import BYE, Deliver, Lost, Transport, exchange_bytes
from ._wire import (
    MAX_ENVELOPE, PREFIX, Frame, check_sizes, pack_envelope, pack_prefix, parse_prefix,
)

__all__ = ["TCPTransport", "ROLE_RPC"]

LOG = logging.getLogger("hpcdp.rpc")

#: handshake role of RPC connections (the store is 1, the world's mesh 2)
ROLE_RPC = 3
_IOV = 512
_DRAIN = 1 << 20
_BYE_ENV = pack_envelope([BYE, 0])


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    tcpwire.recv_into_exact(sock, memoryview(buf))
    return buf


class _Peer:
    __slots__ = ("rank", "sock", "lock", "thread", "said_bye", "dead")

    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank, self.sock = rank, sock
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.said_bye = False
        self.dead: str | None = None


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
        master = os.environ.get("HPCDP_MASTER_ADDR") or os.environ.get("MASTER_ADDR") or "127.0.0.1"
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
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                        struct.pack("ll", int(self.send_timeout),
                                    int((self.send_timeout % 1) * 1e6)))
        peer = _Peer(rank, sock)
        peer.thread = threading.Thread(target=self._read, args=(peer,), daemon=True,
                                       name=f"hpcdp-rpc-tcp{self.rank}<-{rank}")
        self.peers[rank] = peer
        if self.started:
            peer.thread.start()

    def start(self) -> None:
        with self._cv:
            self.started = True
            for p in self.peers.values():
                p.thread.start()

    # -- sending ---------------------------------------------------------------------------
    def send(self, dst: int, env: bytes, body: bytes, buffers: Sequence[memoryview]) -> None:
        peer = self.peers.get(dst)
        if peer is None or peer.dead is not None:
            why = peer.dead if peer is not None else "not connected"
            raise PeerFailureError(f"rpc send from rank {self.rank} to rank {dst}: {why}",
                                   peers=[dst])
        lens = [b.nbytes for b in buffers]
        parts: list[memoryview] = [memoryview(pack_prefix(env, body, lens)), memoryview(env),
                                   memoryview(body)]
        parts.extend(b for b in buffers if b.nbytes)
        with peer.lock:
            if peer.dead is not None:
                raise PeerFailureError(f"rpc send from rank {self.rank} to rank {dst}: "
                                       f"{peer.dead}", peers=[dst])
            try:
                _sendmsg_all(peer.sock, parts)
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

    # -- receiving -------------------------------------------------------------------------
    def _read(self, peer: _Peer) -> None:
        sock, limits = peer.sock, self.limits
        why, graceful = "connection closed", False
        try:
            while True:
                try:
                    raw = _recv_exact(sock, PREFIX.size)
                except ConnectionError:
                    graceful = peer.said_bye
                    why = "it shut down" if graceful else "connection closed by the peer"
                    return
                env_len, body_len, nbuf = parse_prefix(raw, limits)
                lens = struct.unpack(f"<{nbuf}Q", _recv_exact(sock, 8 * nbuf)) if nbuf else ()
                refused = check_sizes(env_len, body_len, lens, limits)
                if refused is not None:
                    env = bytes(_recv_exact(sock, env_len)) if env_len <= MAX_ENVELOPE else None
                    if env is None:
                        _drain(sock, env_len)
                    _drain(sock, body_len + sum(lens))
                    LOG.warning("hpcdp.rpc: rank %d refused a frame from rank %d: %s",
                                self.rank, peer.rank, refused)
                    self.deliver(peer.rank, Frame(env, None, [], refused))
                    continue
                env = bytes(_recv_exact(sock, env_len))
                if env == _BYE_ENV and body_len == 0 and nbuf == 0:
                    peer.said_bye = True
                    continue
                body = _recv_exact(sock, body_len)
                bufs = []
                for n in lens:
                    a = np.empty(n, np.uint8)
                    if n:
                        tcpwire.recv_into_exact(sock, memoryview(a))
                    bufs.append(a)
                self.deliver(peer.rank, Frame(env, body, bufs))
        except (OSError, HpcdpError, struct.error) as exc:
            why = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, ProtocolError):
                LOG.warning("hpcdp.rpc: rank %d dropped its connection from rank %d: %s",
                            self.rank, peer.rank, exc)
        finally:
            if peer.dead is None:
                peer.dead = why
            try:
                sock.close()
            except OSError:
                pass
            if not self.closing:
                self.lost(peer.rank, why, graceful)

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
                    with p.lock:
                        if p.dead is None:
                            p.sock.sendall(pack_prefix(_BYE_ENV, b"", []) + _BYE_ENV)
                            p.sock.shutdown(socket.SHUT_WR)  # the peer reads to our EOF
                except OSError:
                    pass
            deadline = time.monotonic() + timeout
            for p in peers:  # each reader ends at the peer's EOF (it closes after BYE too)
                if p.thread is not None and p.thread.ident is not None:
                    p.thread.join(max(0.0, deadline - time.monotonic()))
        for p in peers:
            try:
                p.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                p.sock.close()
            except OSError:
                pass


def _sendmsg_all(sock: socket.socket, parts: list[memoryview]) -> None:
    """Write every part, resuming after partial writes (at most ``_IOV`` buffers per call)."""
    i = 0
    while i < len(parts):
        n = sock.sendmsg(parts[i:i + _IOV])
        while n and i < len(parts):
            k = parts[i].nbytes
            if n >= k:
                n -= k
                i += 1
            else:
                parts[i] = parts[i][n:]
                n = 0
        while i < len(parts) and parts[i].nbytes == 0:
            i += 1


def _drain(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, _DRAIN) or 1))
    while n > 0:
        k = sock.recv_into(scratch, min(n, len(scratch)))
        if k == 0:
            raise ConnectionError("connection closed while draining a refused frame")
        n -= k
