"""The TCP mesh: one authenticated socket per pair of ranks, tag-matched frames, failure detection.

Progress: one receiver thread per peer reads frames, straight into a posted receive buffer
(``recv_into``, zero copy) when one matches, else into an unexpected-message queue; so a rank always
drains its sockets and two ranks sending large messages to each other never block. Small sends go
out inline on the calling thread (latency); large ones through a per-peer sender thread, so
``isend`` returns at once and the caller can reduce while the bytes move. Matching is per
(source, kind, channel, tag), in order, so messages never overtake.
"""
from __future__ import annotations

import collections
import socket
import threading
from typing import Any

import numpy as np

from ..errors import PeerFailureError, ProtocolError
from . import _tcp_wire as wire
from .base import Request

__all__ = ["Transport", "P2P", "COLL", "BYE", "ABORT"]

P2P, COLL, BYE, ABORT = 1, 2, 3, 4
_KINDS = frozenset({P2P, COLL, BYE, ABORT})
INLINE_BYTES = 64 * 1024
_MORE = 1


class _Req(Request):
    """A send or receive; completion is a released lock, so waiters sleep instead of polling."""

    __slots__ = ("_lock", "done", "error", "view", "nbytes", "desc", "key")

    def __init__(self, view: memoryview | None, desc: str, key: Any = None) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.done = False
        self.error: BaseException | None = None
        self.view = view
        self.nbytes = 0 if view is None else view.nbytes
        self.desc = desc
        self.key = key

    def finish(self, error: BaseException | None = None) -> None:
        if self.done:
            return
        self.error = error
        self.done = True
        self._lock.release()

    def _check(self) -> bool:
        if self.done and self.error is not None:
            raise self.error
        return self.done

    def test(self) -> bool:
        return self._check()

    def wait(self, timeout: float | None) -> bool:
        if not self.done:
            if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                self._lock.release()
        return self._check()

    def pending(self) -> str:
        return self.desc


class _Peer:
    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.send_lock = threading.Lock()
        self.qcv = threading.Condition()
        self.sendq: collections.deque[tuple[bytes, memoryview, _Req]] = collections.deque()
        self.sender: threading.Thread | None = None
        self.eof = threading.Event()


def _as_bytes(buf: np.ndarray) -> memoryview:
    return memoryview(buf).cast("B") if buf.nbytes else memoryview(bytearray(0))


class Transport:
    """This process's half of the full mesh; shared by every group (channel) of the job."""

    def __init__(self, rank: int, size: int, cap: int) -> None:
        self.rank, self.size, self.cap = rank, size, cap
        self.peers: dict[int, _Peer] = {}
        self.lock = threading.Lock()
        self.posted: dict[tuple, collections.deque[_Req]] = {}
        self.unexpected: dict[tuple, collections.deque[bytes]] = {}
        self.dead: dict[int, str] = {}
        #: dead without saying goodbye: fails every collective of a group that contains them
        self.crashed: set[int] = set()
        self.aborted: dict[tuple[int, int], str] = {}  # (kind, channel) -> why
        self.closing = False

    # -- setup ------------------------------------------------------------------------------
    def add_peer(self, rank: int, sock: socket.socket) -> None:
        wire.set_nodelay(sock)
        peer = _Peer(rank, sock)
        self.peers[rank] = peer
        threading.Thread(target=self._recv_loop, args=(peer,), daemon=True,
                         name=f"hpcdp-recv-{self.rank}<{rank}").start()

    # -- failure ----------------------------------------------------------------------------
    def mark_dead(self, rank: int, why: str, crashed: bool = True) -> None:
        with self.lock:
            if rank in self.dead:
                return
            self.dead[rank] = why
            if crashed:
                self.crashed.add(rank)
            failed = [(k, q) for k, q in self.posted.items() if k[0] == rank]
            for k, _ in failed:
                del self.posted[k]
        err = PeerFailureError(f"rank {rank} {why}", peers=[rank])
        for _, q in failed:
            for rq in q:
                rq.finish(err)
        peer = self.peers.get(rank)
        if peer is not None:
            with peer.qcv:
                queued = list(peer.sendq)
                peer.sendq.clear()
                peer.qcv.notify_all()
            for _, _, rq in queued:
                rq.finish(err)

    def abort_channel(self, kind: int, channel: int, why: str, members: tuple[int, ...],
                      notify: bool) -> None:
        """Fail pending receives of one group's collectives (after a timeout, or a peer's)."""
        with self.lock:
            self.aborted.setdefault((kind, channel), why)
            failed = [k for k in self.posted if k[1] == kind and k[2] == channel]
            qs = [self.posted.pop(k) for k in failed]
        err = PeerFailureError(why)
        for q in qs:
            for rq in q:
                rq.finish(err)
        if notify:
            for r in members:
                if r != self.rank and r not in self.dead:
                    self._send_frame(r, ABORT, channel, kind, memoryview(b""), _Req(None, "abort"))

    # -- receiving --------------------------------------------------------------------------
    def _recv_loop(self, peer: _Peer) -> None:
        sock, src = peer.sock, peer.rank
        cur: list[Any] | None = None  # [key, req or None, offset, chunks]
        why, crashed = "closed its connection (process exited or crashed)", True
        try:
            while True:
                raw = wire.recv_exact(sock, wire.HEADER.size)
                kind, flags, channel, tag, n = wire.unpack_header(raw, _KINDS, self.cap)
                if kind == BYE:
                    why, crashed = "has shut down (finalize)", False
                    continue
                if kind == ABORT:
                    self.abort_channel(tag, channel, f"rank {src} abandoned a collective on this "
                                       "group after a timeout", (), notify=False)
                    continue
                if cur is None:
                    key = (src, kind, channel, tag)
                    with self.lock:
                        q = self.posted.get(key)
                        req = q.popleft() if q else None
                        if q is not None and not q:
                            del self.posted[key]
                    cur = [key, req, 0, []]
                key, req, off, chunks = cur
                if req is not None and req.error is None and off + n <= req.nbytes:
                    wire.recv_into_exact(sock, req.view[off:off + n])
                else:
                    chunks.append(bytes(wire.recv_exact(sock, n)))
                cur[2] = off + n
                if flags & _MORE:
                    continue
                cur = None
                if req is not None:
                    self._finish_recv(req, off + n, chunks)
                    continue
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                with self.lock:
                    q = self.posted.get(key)
                    req = q.popleft() if q else None
                    if q is not None and not q:
                        del self.posted[key]
                    if req is None:
                        self.unexpected.setdefault(key, collections.deque()).append(data)
                if req is not None:
                    self._deliver(req, data)
        except ProtocolError as exc:
            wire.log_rejection(_addr(sock), f"rank {self.rank} frames from rank {src}", exc)
            why, crashed = f"sent a malformed frame ({exc})", True
        except (OSError, ConnectionError):
            pass
        peer.eof.set()
        self.mark_dead(src, why, crashed)

    def _finish_recv(self, req: _Req, got: int, chunks: list[bytes]) -> None:
        if got != req.nbytes or chunks:
            req.finish(ValueError(f"{req.desc}: message has {got} bytes, buffer has {req.nbytes}"))
        else:
            req.finish()

    def _deliver(self, req: _Req, data: bytes) -> None:
        if len(data) != req.nbytes:
            req.finish(ValueError(f"{req.desc}: message has {len(data)} bytes, buffer has "
                                  f"{req.nbytes}"))
            return
        req.view[:] = data
        req.finish()

    def irecv(self, buf: np.ndarray, src: int, kind: int, channel: int, tag: int, desc: str) -> _Req:
        key = (src, kind, channel, tag)
        req = _Req(_as_bytes(buf), desc, key)
        with self.lock:
            box = self.unexpected.get(key)
            data = box.popleft() if box else None
            if box is not None and not box:
                del self.unexpected[key]
            if data is None:
                why = self.aborted.get((kind, channel)) if kind == COLL else None
                if src in self.dead:
                    why = f"rank {src} {self.dead[src]}"
                if why is None:
                    self.posted.setdefault(key, collections.deque()).append(req)
                    return req
        if data is not None:
            self._deliver(req, data)
        else:
            req.finish(PeerFailureError(f"{desc}: {why}", peers=[src] if src in self.dead else []))
        return req

    # -- sending ----------------------------------------------------------------------------
    def isend(self, buf: np.ndarray, dst: int, kind: int, channel: int, tag: int, desc: str) -> _Req:
        view = _as_bytes(buf)
        req = _Req(view, desc)
        if dst == self.rank:  # loopback: match locally, copying (the sender may reuse buf)
            data = bytes(view)
            key = (dst, kind, channel, tag)
            with self.lock:
                q = self.posted.get(key)
                rq = q.popleft() if q else None
                if q is not None and not q:
                    del self.posted[key]
                if rq is None:
                    self.unexpected.setdefault(key, collections.deque()).append(data)
            if rq is not None:
                self._deliver(rq, data)
            req.finish()
            return req
        if dst in self.dead:
            req.finish(PeerFailureError(f"{desc}: rank {dst} {self.dead[dst]}", peers=[dst]))
            return req
        self._send_frame(dst, kind, channel, tag, view, req)
        return req

    def _send_frame(self, dst: int, kind: int, channel: int, tag: int, view: memoryview,
                    req: _Req) -> None:
        peer = self.peers[dst]
        hdr = (kind, channel, tag)
        inline = False
        with peer.qcv:
            # user p2p sends go out on the caller's thread (no handoff); large collective pieces
            # go through the sender thread so the algorithm can reduce while they move
            small = view.nbytes <= INLINE_BYTES or kind == P2P
            if small and not peer.sendq and peer.send_lock.acquire(False):
                inline = True
            else:
                peer.sendq.append((hdr, view, req))  # type: ignore[arg-type]
                if peer.sender is None:
                    peer.sender = threading.Thread(target=self._send_loop, args=(peer,),
                                                   daemon=True, name=f"hpcdp-send-{self.rank}>{dst}")
                    peer.sender.start()
                peer.qcv.notify()
        if inline:
            try:
                self._write(peer, hdr, view)
            except OSError as exc:
                req.finish(PeerFailureError(f"{req.desc}: rank {dst} connection lost ({exc})",
                                            peers=[dst]))
                self.mark_dead(dst, f"connection lost while sending ({exc})")
                return
            finally:
                peer.send_lock.release()
            req.finish()

    def _write(self, peer: _Peer, hdr: tuple, view: memoryview) -> None:
        kind, channel, tag = hdr
        n = view.nbytes
        sock = peer.sock
        if n <= INLINE_BYTES:
            sock.sendall(wire.pack_header(kind, 0, channel, tag, n) + view.tobytes())
            return
        step = self.cap
        for a in range(0, n, step):
            b = min(n, a + step)
            sock.sendall(wire.pack_header(kind, _MORE if b < n else 0, channel, tag, b - a))
            sock.sendall(view[a:b])

    def _send_loop(self, peer: _Peer) -> None:
        while True:
            with peer.qcv:
                while not peer.sendq:
                    if self.closing or peer.rank in self.dead:
                        peer.sender = None
                        return
                    peer.qcv.wait()
                hdr, view, req = peer.sendq.popleft()
                peer.send_lock.acquire()  # under qcv: an inline send cannot overtake this one
            try:
                self._write(peer, hdr, view)
                req.finish()
            except OSError as exc:
                req.finish(PeerFailureError(f"{req.desc}: rank {peer.rank} connection lost ({exc})",
                                            peers=[peer.rank]))
                peer.send_lock.release()
                self.mark_dead(peer.rank, f"connection lost while sending ({exc})")
                continue
            peer.send_lock.release()

    # -- shutdown ---------------------------------------------------------------------------
    def close(self, flush_timeout: float = 5.0) -> None:
        """Flush queued sends, say goodbye, and close once peers have closed too (bounded)."""
        import time

        deadline = time.monotonic() + flush_timeout
        for peer in self.peers.values():
            with peer.qcv:
                while peer.sendq and peer.rank not in self.dead:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    peer.qcv.wait(min(left, 0.05))
        self.closing = True
        for peer in self.peers.values():
            with peer.qcv:
                peer.qcv.notify_all()
            if peer.rank in self.dead:
                continue
            try:
                with peer.send_lock:
                    peer.sock.sendall(wire.pack_header(BYE, 0, 0, 0, 0))
                peer.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        for peer in self.peers.values():
            peer.eof.wait(max(0.0, min(1.0, deadline - time.monotonic())))
            try:
                peer.sock.close()
            except OSError:
                pass


def _addr(sock: socket.socket) -> object:
    try:
        return sock.getpeername()
    except OSError:
        return "?"
