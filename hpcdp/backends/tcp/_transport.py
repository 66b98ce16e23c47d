"""The TCP mesh: one authenticated socket per pair of ranks, tag-matched frames, failure detection.

Progress: frames from a peer are read, straight into a posted receive buffer (``recv_into``, zero
copy) when one matches, else into an unexpected-message queue, by whichever thread holds that
peer's read lock. A thread that waits for a small or point-to-point receive takes the lock and
reads the socket itself (no thread handoff: this is what makes latency close to a raw socket's);
otherwise one background receiver thread per peer does it, so a rank always drains its sockets and
two ranks sending large messages to each other never block. The background thread stands aside
while a waiter reads directly (and for a short linger after, so a ping-pong does not wake it on
every message). Small sends go out inline on the calling thread (latency); large ones through a
per-peer sender thread, so ``isend`` returns at once and the caller can reduce while the bytes move.
A channel may bound how long its writes wait on a peer that takes no byte (``bound_sends``: RPC's
duplicate); past it the peer is failed, as a stream cut in the middle of a frame cannot go on.
A thread that tests a receive or probes reads only up to the message it looks for: what follows
stays on the socket a while longer, so a receive its caller posts next (``hpcdp.rpc`` reads a
head, then posts receives for the data behind it) still gets its bytes in place. A message that
did arrive before its receive is handed over as the buffer it was read into (``take``).
No frame is larger than the cap (``HPCDP_MAX_FRAME``), whatever the message size.
Matching is per (source, kind, channel, tag), in order, so messages never overtake. The frame
parser itself (resumable at any byte) is ``_frames.FrameReader`` and the collective signature
checks are ``_coll.CollChecks``: parts the transport holds (``frames``, ``checks``), each given
the shared queues and locks it uses when it is built.
"""
from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from ...errors import PeerFailureError, ProtocolError
from . import _wire as wire
from ._coll import CollChecks
from ._frames import ABORT, BYE, COLL, MORE, NOTE_CAP, P2P, RECV_TICK, WAITING, FrameReader
from ._peer import _Peer, _Req, _Sent, _text
from ._wire import p2p_refuses
from ..base import ANY_TAG, Request

__all__ = ["Transport", "P2P", "COLL", "BYE", "ABORT"]

INLINE_BYTES = 64 * 1024
#: a thread waiting for a receive this small (or any user p2p receive) reads the socket itself
DIRECT_BYTES = 256 * 1024
#: after a direct read the background receiver stays parked this long (seconds) unless kicked
LINGER = 0.002
#: a receive's own transfer, at this pace (1 GB/s), does not count as waiting (``_direct_wait``)
_TRANSFER_SECONDS_PER_BYTE = 1e-9
#: how long (seconds) a probe waits for a peer's socket that another thread is reading
PROBE_WAIT = 2e-4
_EMPTY = memoryview(bytearray(0))
_pack = wire.HEADER.pack
_monotonic = time.monotonic
_NOSIG = wire.NOSIG


def _as_bytes(buf: np.ndarray) -> memoryview:
    return memoryview(buf).cast("B") if buf.nbytes else memoryview(bytearray(0))


class Transport:
    """This process's half of the full mesh; shared by every group (channel) of the job.

    It holds the sockets, the posted and unexpected queues (under ``lock``) and the failure
    state, and two parts built over them: ``checks`` (``CollChecks``, the collective signature
    checks; the groups' runners call it) and ``frames`` (``FrameReader``, the frame parser
    every reading thread runs)."""

    def __init__(self, rank: int, size: int, cap: int) -> None:
        self.rank, self.size, self.cap = rank, size, cap
        #: largest message sent as one frame on the caller's thread
        self.inline = min(INLINE_BYTES, cap)
        self.peers: dict[int, _Peer] = {}
        #: rank -> " at ADDRESS (HOST)" for peers on another host, "" for loopback ones: what
        #: a timeout names, so that an operator sees which node went missing, not only a rank
        self.where: dict[int, _Where | str] = {}
        self.lock = threading.Lock()
        self.posted: dict[tuple, collections.deque[_Req]] = {}
        self.unexpected: dict[tuple, collections.deque[tuple[Any, tuple]]] = {}
        self.dead: dict[int, str] = {}
        #: dead without saying goodbye: fails every collective of a group that contains them
        self.crashed: set[int] = set()
        self.aborted: dict[tuple[int, int], str] = {}  # (kind, channel) -> why
        self.unposted_caps: dict[int, int] = {}
        #: (channel, tag) -> cap that wins over the channel's (``cap_unposted(nbytes, tag)``)
        self.unposted_tag_caps: dict[tuple[int, int], int] = {}
        #: channel -> seconds a write of its frames may go without the peer taking a byte
        #: (``bound_sends``); channels not listed wait as long as it takes
        self.send_limits: dict[int, float] = {}
        self.closing = False
        self.checks = CollChecks(rank=rank, cap=cap, lock=self.lock, unexpected=self.unexpected,
                                 dead=self.dead, aborted=self.aborted,
                                 abort_channel=self.abort_channel, send_frame=self._send_frame)
        self.frames = FrameReader(rank=rank, cap=cap, lock=self.lock, posted=self.posted,
                                  unexpected=self.unexpected, unposted_caps=self.unposted_caps,
                                  unposted_tag_caps=self.unposted_tag_caps,
                                  abort_channel=self.abort_channel, checks=self.checks)

    # -- setup ------------------------------------------------------------------------------
    def add_peer(self, rank: int, sock: socket.socket) -> None:
        wire.set_nodelay(sock)
        sock.settimeout(None)
        # receive-only kernel timeout: a blocking recv() returns EAGAIN after RECV_TICK (sends are
        # unaffected), so a thread that reads for itself never sleeps past its deadline
        sec = int(RECV_TICK)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        struct.pack("ll", sec, int((RECV_TICK - sec) * 1e6)))
        _set_send_tick(sock, min(self.send_limits.values(), default=0.0))
        peer = _Peer(rank, sock)
        addr = _addr(sock)
        if isinstance(addr, tuple) and not str(addr[0]).startswith("127."):
            self.where[rank] = _Where(str(addr[0]))
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
                      notify: bool, error: type[Exception] = PeerFailureError) -> None:
        """Fail pending receives of one group's collectives (after a timeout, or a peer's, or
        a mismatch: then ``error`` is ``CollectiveMismatchError``)."""
        with self.lock:
            self.aborted.setdefault((kind, channel), why)
            failed = [k for k in self.posted if k[1] == kind and k[2] == channel]
            qs = [self.posted.pop(k) for k in failed]
        err = error(why)
        for q in qs:
            for rq in q:
                rq.finish(err)
        if notify:
            for r in members:
                if r != self.rank and r not in self.dead:
                    self._send_frame(r, ABORT, channel, kind, memoryview(b""), _Req(None, "abort"))

    # -- receiving (frames are parsed by ``frames``) ----------------------------------------
    def _reader_failed(self, peer: _Peer, exc: BaseException) -> None:
        """The stream from ``peer`` ended (the caller holds ``peer.rlock``)."""
        if peer.stopped:
            return
        peer.stopped = True
        if isinstance(exc, ProtocolError):
            wire.log_rejection(_addr(peer.sock), f"rank {self.rank} frames from rank {peer.rank}",
                               exc)
            peer.why, peer.crashed = f"sent a malformed frame ({exc})", True
        peer.eof.set()
        self.mark_dead(peer.rank, peer.why, peer.crashed)
        cur, peer.cur, peer.fill = peer.cur, None, None  # a message cut off by the end
        if cur is not None and cur[1] is not None:
            cur[1].finish(PeerFailureError(f"rank {peer.rank} {peer.why}", peers=[peer.rank]))
        with peer.bgcv:
            peer.bgcv.notify_all()

    def _kick(self, peer: _Peer) -> None:
        """End the background receiver's linger now (a large receive wants it reading)."""
        with peer.bgcv:
            peer.linger_until = 0.0
            if peer.parked:
                peer.bgcv.notify_all()

    def _recv_loop(self, peer: _Peer) -> None:
        """Background progress: read whatever arrives while no waiter reads the socket itself."""
        rlock, bgcv, poll = peer.rlock, peer.bgcv, peer.bg_poll.poll
        read_frame = self.frames.read_frame
        backoff = LINGER
        try:
            while not peer.stopped:
                with bgcv:
                    left = peer.linger_until - _monotonic()
                    if left > 0 or rlock.locked():
                        # a waiter is reading (or just was): stay out of its way, waking rarely
                        peer.parked = True
                        bgcv.wait(max(left, backoff))
                        peer.parked = False
                        backoff = min(2 * backoff, 0.1)
                        continue
                backoff = LINGER
                if not (peer.send > peer.spos or poll(500)) or not rlock.acquire(False):
                    continue
                try:
                    # one burst: what has arrived, while no waiter wants the socket
                    while (not peer.stopped and peer.linger_until <= _monotonic()
                           and (peer.send > peer.spos or peer.direct_poll.poll(0))):
                        read_frame(peer)
                except (ProtocolError, OSError, ConnectionError) as exc:
                    self._reader_failed(peer, exc)
                finally:
                    rlock.release()
        finally:
            peer.eof.set()

    def _direct_wait(self, req: _Req, peer: _Peer, timeout: float | None) -> None:
        """Wait for ``req`` by reading ``peer``'s socket on this thread when nobody else does."""
        deadline = None if timeout is None else _monotonic() + max(0.0, timeout)
        rlock, poll = peer.rlock, peer.direct_poll.poll
        read_frame = self.frames.read_frame
        while not req.done:
            if rlock.acquire(False):
                t0 = peer.linger_until = _monotonic()
                peer.linger_until = t0 + LINGER
                try:
                    while not req.done and not peer.stopped:
                        if deadline is not None:
                            left = deadline - _monotonic()
                            if left <= 0:
                                break
                            if (left < RECV_TICK and peer.send <= peer.spos
                                    and not poll(max(1, int(left * 1000 + 0.999)))):
                                break
                        read_frame(peer, deadline)
                except (ProtocolError, OSError, ConnectionError) as exc:
                    self._reader_failed(peer, exc)
                finally:
                    t1 = _monotonic()
                    # a long wait, not a ping-pong: hand back at once. The time the bytes
                    # take to arrive at a slow link's pace is not waiting: a ping-pong of large
                    # messages keeps reading on the caller's thread, with no hand-over per message
                    if t1 - t0 > LINGER + req.nbytes * _TRANSFER_SECONDS_PER_BYTE:
                        rlock.release()
                        self._kick(peer)
                    else:
                        peer.linger_until = t1 + LINGER
                        rlock.release()
                if req.done or peer.stopped:
                    break
            else:
                # another thread reads this socket: it delivers our message or gives it up soon
                wait = 0.0005 if deadline is None else min(0.0005, deadline - _monotonic())
                if wait > 0 and req._lock.acquire(timeout=wait):
                    req._lock.release()
            if deadline is not None and _monotonic() >= deadline:
                break
        if not req.done and peer.stopped:
            # the stream ended: mark_dead fails every receive from the peer in a moment
            left = -1.0 if deadline is None else max(0.0, deadline - _monotonic())
            if req._lock.acquire(timeout=left):
                req._lock.release()

    def _poll_once(self, peer: _Peer, until: Callable[[], bool], busy_wait: float = 0.0) -> None:
        """``test()``, ``probe()``: read what has already arrived, without blocking, if the
        socket is free, and stop as soon as ``until()`` holds (the caller's message is in):
        the frames after it stay on the socket for whoever needs them next, so a receive
        posted meanwhile gets its message straight into its buffer (``probe``).

        ``busy_wait``: while another thread reads the socket, wait this long for it (asleep)
        rather than return at once: a caller that polls in a loop would otherwise hold the
        interpreter between polls that never sleep, and the reading thread, back from each
        socket read, would wait for the interpreter's forced switch (milliseconds).
        """
        if not peer.rlock.acquire(False) and not (
                busy_wait and peer.rlock.acquire(timeout=busy_wait)):
            return
        try:
            poll, read_frame = peer.direct_poll.poll, self.frames.read_frame
            peer.queued = None
            while not peer.stopped and (peer.send > peer.spos or poll(0)):
                if not read_frame(peer, _monotonic()):  # a frame still arriving: later
                    break
                if until():
                    break
        except (ProtocolError, OSError, ConnectionError) as exc:
            self._reader_failed(peer, exc)
        finally:
            peer.rlock.release()

    def irecv(self, buf: np.ndarray, src: int, kind: int, channel: int, tag: int,
              desc: Any, sig: tuple = _NOSIG) -> _Req:
        key = (src, kind, channel, tag)
        req = _Req(memoryview(buf).cast("B") if buf.nbytes else _EMPTY, desc, key, sig)
        req.owner = self
        with self.lock:
            data = None
            if self.unexpected:
                box = self.unexpected.get(key)
                if box:
                    if kind == P2P and p2p_refuses(sig, box[0][1]):  # left for another receive
                        req.finish(self.frames.refusal(req, box[0][1], len(box[0][0])))
                        return req
                    data, msig = box.popleft()
                    if not box:
                        del self.unexpected[key]
            if data is None:
                why = self.aborted.get((kind, channel)) if kind == COLL and self.aborted else None
                if src in self.dead:
                    why = f"rank {src} {self.dead[src]}"
                if why is None:
                    q = self.posted.get(key)
                    if q is None:
                        self.posted[key] = q = collections.deque()
                    q.append(req)
                    peer = self.peers.get(src)
                    if peer is not None:
                        if kind == P2P or req.nbytes <= DIRECT_BYTES:
                            req.reader = (self, peer)
                        elif peer.linger_until:
                            self._kick(peer)
                    return req
        if data is not None:
            self.frames.deliver(req, data, msig)
        else:
            req.finish(PeerFailureError(f"{_text(desc)}: {why}",
                                        peers=[src] if src in self.dead else []))
        return req

    def probe(self, srcs: Sequence[int], channel: int, tag: int, with_sig: bool = False
              ) -> tuple[Any, ...] | None:
        """(source, tag, nbytes) of a whole p2p message on ``channel`` from one of ``srcs`` that
        no receive has taken yet (``tag`` -1: any), else None; ``with_sig``: and its header's
        signature fields (the dtype and shape it was sent with, ``_wire.p2p_meta``).

        Reads from the sockets only when no queued message matches, and then only up to the
        first one that does: a prober that posts receives for what follows (``hpcdp.rpc``
        reads a head, then posts the receives its data messages will match) finds the data
        still on the socket, and it lands in the posted buffer, not in the unexpected queue.
        """
        found = self._queued(srcs, channel, tag, with_sig)
        if found is not None:
            return found

        def matched(peer: _Peer) -> Callable[[], bool]:
            def until() -> bool:
                q = peer.queued
                return q is not None and q[1] == P2P and q[2] == channel and tag in (ANY_TAG, q[3])
            return until

        for s in srcs:
            peer = self.peers.get(s)
            if peer is not None:
                self._poll_once(peer, matched(peer), PROBE_WAIT)
                if peer.queued is not None and matched(peer)():
                    break
        found = self._queued(srcs, channel, tag, with_sig)
        if found is not None:
            return found
        dead = [s for s in srcs if s in self.dead]
        if dead and len(dead) == len(srcs):
            raise PeerFailureError(f"probe on rank {self.rank}: rank {dead[0]} {self.dead[dead[0]]}",
                                   peers=dead)
        return None

    def _queued(self, srcs: Sequence[int], channel: int, tag: int, with_sig: bool = False
                ) -> tuple[Any, ...] | None:
        with self.lock:
            for (s, kind, ch, t), box in self.unexpected.items():
                if box and kind == P2P and ch == channel and s in srcs and tag in (ANY_TAG, t):
                    return (s, t, len(box[0][0]), box[0][1]) if with_sig else (s, t, len(box[0][0]))
        return None

    def take(self, src: int, channel: int, tag: int) -> np.ndarray | None:
        """The oldest queued p2p message from ``src`` with ``tag`` on ``channel``, handed over
        as the buffer the reader filled (no copy), or None where none is queued or it is not
        one writable buffer (a loopback message, one joined from several frames)."""
        key = (src, P2P, channel, tag)
        with self.lock:
            box = self.unexpected.get(key)
            if not box or type(box[0][0]) not in (bytearray, np.ndarray):
                return None
            data = box.popleft()[0]
            if not box:
                del self.unexpected[key]
        return data if type(data) is np.ndarray else np.frombuffer(data, np.uint8)

    def tell_waiting(self, dsts: Sequence[int], note: str) -> None:
        """Send ``note`` (what this rank is blocked in) to world ranks ``dsts`` as a WAITING
        control frame: never matched by a receive, kept by the peer's reader (``frames.waits``).
        Queued for the sender thread, so a caller never blocks on a peer's full socket."""
        raw = note.encode("utf-8", "replace")[:min(NOTE_CAP, self.cap)]
        for r in dsts:
            if r != self.rank and r in self.peers and r not in self.dead:
                self._send_frame(r, WAITING, 0, 0, memoryview(raw), _Req(None, "waiting note"),
                                 queue_only=True)

    def close_channel(self, channel: int) -> None:
        """Forget a channel's cap and the p2p messages no receive took (``TCPBackend.shutdown``)."""
        if channel in self.send_limits:
            self.bound_sends(channel, None)
        with self.lock:
            self.unposted_caps.pop(channel, None)
            for k in [k for k in self.unposted_tag_caps if k[0] == channel]:
                del self.unposted_tag_caps[k]
            for key in [k for k in self.unexpected if k[1] == P2P and k[2] == channel]:
                del self.unexpected[key]

    def _unpost(self, req: _Req) -> bool:
        """Withdraw a receive given up on; True if its message had completed after all.

        If the message is already arriving, whoever reads next moves it to buffers of its own
        before its next read (at once, here, if no thread is reading) and fails ``req``: the
        message then waits for a later receive, as if it had come after the timeout.
        """
        with self.lock:
            if req.claimed or req.done:
                claimed = True
            else:
                claimed, req.abandoned = False, True
                q = self.posted.get(req.key)
                queued = q is not None and req in q
                if queued:
                    q.remove(req)
                    if not q:
                        del self.posted[req.key]
        if claimed:  # handed over just as the deadline passed: it is (about to be) complete
            if req._lock.acquire(timeout=5.0):
                req._lock.release()
            return req.done and req.error is None
        if queued:
            req.finish(PeerFailureError(f"{_text(req.desc)}: abandoned after a timeout"))
            return False
        peer = self.peers.get(req.key[0])
        # A reader busy with the message redirects it after its current read (at most a
        # RECV_TICK): wait for that, so no byte lands in the buffer once the caller has it back.
        until = _monotonic() + 2 * RECV_TICK + 0.05
        while peer is not None and peer.cur is not None and peer.cur[1] is req:
            if peer.rlock.acquire(timeout=0.01):
                try:
                    if peer.cur is not None and peer.cur[1] is req:
                        self.frames.redirect(peer)
                finally:
                    peer.rlock.release()
                break
            if _monotonic() > until:
                break
        return False

    # -- sending ----------------------------------------------------------------------------
    def isend(self, buf: np.ndarray, dst: int, kind: int, channel: int, tag: int,
              desc: Any, sig: tuple = _NOSIG) -> Request:
        n = buf.nbytes
        if n <= self.inline:
            # fast path: a small frame goes out on this thread, header and payload in one write
            peer = self.peers.get(dst)
            if peer is not None and dst not in self.dead:
                with peer.qlock:
                    inline = not peer.sendq and peer.send_lock.acquire(False)
                if inline:
                    try:
                        self._put(peer, _pack(kind, 0, *sig, channel, tag, n) + memoryview(buf),
                                  channel)
                    except OSError as exc:
                        peer.send_lock.release()
                        why = self._send_failed(peer, exc)
                        req = _Req(None, desc)
                        req.finish(PeerFailureError(f"{_text(desc)}: rank {dst} {why}", peers=[dst]))
                        return req
                    peer.send_lock.release()
                    return _Sent(desc)
        view = _as_bytes(buf)
        req = _Req(view, desc)
        if dst == self.rank:  # loopback: match locally, copying (the sender may reuse buf)
            self.frames.arrived((dst, kind, channel, tag), bytes(view), sig)
            req.finish()
            return req
        if dst in self.dead:
            req.finish(PeerFailureError(f"{_text(desc)}: rank {dst} {self.dead[dst]}", peers=[dst]))
            return req
        self._send_frame(dst, kind, channel, tag, view, req, sig=sig)
        return req

    def _send_frame(self, dst: int, kind: int, channel: int, tag: int, view: memoryview,
                    req: _Req, *, sig: tuple = _NOSIG, queue_only: bool = False) -> None:
        """Send one message; ``queue_only`` (reader threads) never writes on this thread, so a
        reader cannot block on a full socket while its peer blocks the same way."""
        peer = self.peers[dst]
        hdr = (kind, channel, tag, sig)
        inline = False
        with peer.qcv:
            # user p2p sends go out on the caller's thread (no handoff); large collective pieces
            # go through the sender thread so the algorithm can reduce while they move
            small = (view.nbytes <= INLINE_BYTES or kind == P2P) and not queue_only
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
            failed: OSError | None = None
            t0 = _monotonic()
            try:
                self._write(peer, hdr, view)
            except OSError as exc:
                failed = exc
            finally:
                # released before the peer is failed: a sender thread waits for it holding
                # ``qcv``, which ``mark_dead`` takes
                peer.send_lock.release()
            if kind == P2P and peer.linger_until > t0:
                # a thread that reads this peer's socket itself, now sending to it (a
                # ping-pong): the background receiver stays parked through the send too, or
                # a large send outlasts the linger and the reply goes through a hand-over
                peer.linger_until = _monotonic() + LINGER
            if failed is not None:
                why = self._send_failed(peer, failed)
                req.finish(PeerFailureError(f"{_text(req.desc)}: rank {dst} {why}", peers=[dst]))
                return
            req.finish()

    def _write(self, peer: _Peer, hdr: tuple, view: memoryview) -> None:
        kind, channel, tag, sig = hdr
        n = view.nbytes
        put = self._put
        if n <= self.inline:
            put(peer, _pack(kind, 0, *sig, channel, tag, n) + view.tobytes(), channel)
            return
        step = self.cap
        for a in range(0, n, step):
            b = min(n, a + step)
            put(peer, _pack(kind, MORE if b < n else 0, *sig, channel, tag, b - a), channel)
            put(peer, view[a:b], channel)

    def _put(self, peer: _Peer, data: Any, channel: int) -> None:
        """``sock.sendall(data)``, bounded where ``channel`` has a send limit (``bound_sends``):
        a peer that takes no byte of it for that long (stopped, hung: a live rank's receiver
        threads always drain its sockets) raises ``SendStalled``. The socket's ``SO_SNDTIMEO``
        (the smallest limit of any channel) makes a blocked ``send`` return, so a write on a
        channel without a limit just goes on; the fast path is the one ``send`` call."""
        sock = peer.sock
        try:
            done = sock.send(data)
        except BlockingIOError:  # a whole SO_SNDTIMEO without a byte taken
            done = -1
        n = len(data)  # bytes, or a flat view of bytes (``_as_bytes``)
        if done == n:
            return
        quiet = _monotonic()  # since when the peer has taken no byte (about)
        if done < 0:
            done, quiet = 0, quiet - min(self.send_limits.values(), default=0.0)
        view = memoryview(data)
        while done < n:
            try:
                k = sock.send(view[done:])
            except BlockingIOError:  # SO_SNDTIMEO passed without a byte taken
                limit = self.send_limits.get(channel)
                waited = _monotonic() - quiet
                if limit is not None and waited >= limit:
                    raise SendStalled(f"stopped reading: it took no byte of a frame for "
                                      f"{waited:.1f} s (send limit {limit:g} s)") from None
                continue
            done += k
            quiet = _monotonic()

    def _send_failed(self, peer: _Peer, exc: OSError) -> str:
        """A write to ``peer`` failed: mark it dead, and why (for the errors that name it).
        A stalled peer's stream holds part of a frame, so its connection is shut as well: the
        peer, if it wakes, reads the cut and fails too, and threads blocked on it return."""
        if isinstance(exc, SendStalled):
            self.mark_dead(peer.rank, str(exc))
            try:
                peer.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        else:
            self.mark_dead(peer.rank, f"connection lost while sending ({exc})")
        return self.dead.get(peer.rank, str(exc))  # the first failure's: why it is gone

    def bound_sends(self, channel: int, seconds: float | None) -> None:
        """Let writes of ``channel``'s frames wait at most ``seconds`` for a peer that takes no
        byte (then the peer is failed, ``SendStalled``); None: no bound. Sets every peer
        socket's ``SO_SNDTIMEO`` to the smallest bound of any channel."""
        if seconds is None:
            self.send_limits.pop(channel, None)
        else:
            self.send_limits[channel] = float(seconds)
        tick = min(self.send_limits.values(), default=0.0)
        for peer in list(self.peers.values()):
            try:
                _set_send_tick(peer.sock, tick)
            except OSError:
                pass

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
                peer.send_lock.release()
                why = self._send_failed(peer, exc)
                req.finish(PeerFailureError(f"{_text(req.desc)}: rank {peer.rank} {why}",
                                            peers=[peer.rank]))
                continue
            finally:
                # the frame is out: let go of the sender's buffer now, not when the next frame
                # comes (the last large send of a run would stay alive for good)
                view = req = None  # type: ignore[assignment]
            peer.send_lock.release()

    # -- shutdown ---------------------------------------------------------------------------
    def close(self, flush_timeout: float = 5.0) -> None:
        """Flush queued sends, say goodbye, and close once peers have closed too (bounded)."""
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


class SendStalled(TimeoutError):
    """A peer took no byte of a frame for its channel's send limit (``Transport.bound_sends``)."""


def _set_send_tick(sock: socket.socket, seconds: float) -> None:
    """``SO_SNDTIMEO``: a blocked ``send`` returns after ``seconds`` without progress (0: never)."""
    sec = int(seconds)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                    struct.pack("ll", sec, int((seconds - sec) * 1e6)))


class _Where:
    """`` at 10.0.0.2 (node02)``: a peer's address and, looked up only when an error message is
    formatted (never while ranks connect: a slow resolver must not delay the mesh), its name."""

    __slots__ = ("ip", "_text")

    def __init__(self, ip: str) -> None:
        self.ip = ip
        self._text: str | None = None

    def __str__(self) -> str:
        if self._text is None:
            try:
                name = socket.gethostbyaddr(self.ip)[0]
            except (OSError, UnicodeError):
                name = ""
            self._text = f" at {self.ip}" + (f" ({name})" if name and name != self.ip else "")
        return self._text


def _addr(sock: socket.socket) -> object:
    try:
        return sock.getpeername()
    except OSError:
        return "?"
