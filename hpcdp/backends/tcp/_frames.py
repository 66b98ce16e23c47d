"""Reading frames off a peer's socket: the one parser every receiving thread runs.

A frame is ``[HEADER][payload]`` (``_wire``); a message is one or more frames, the last
without the MORE flag. The parser matches a message to a posted receive when its first frame
arrives and reads the payload straight into that buffer (zero copy), else into buffers of its
own that the unexpected-message queue keeps. Its state lives on the ``_Peer`` (``cur``: the
message, ``fill``: the frame's payload in progress, the read-ahead stage), updated after every
read, so whichever thread holds the peer's read lock can stop at any byte (a deadline, an
exception) and any thread can resume: a peer that stalls mid-message never holds a waiter past
its deadline, and Ctrl-C in a receive loses no byte of the stream. Collective frames carry
their call's signature, which is compared with the receive's (``_coll``) before a byte of
the payload lands in the receive's buffer.
"""
from __future__ import annotations

import collections
import socket
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from ...errors import CollectiveMismatchError, PeerFailureError, ProtocolError
from ..._arrays import SUPPORTED_DTYPES
from ..base import FINALIZED
from . import _wire as wire
from ._peer import _STAGE, _Peer, _Req, _text

if TYPE_CHECKING:
    from ._coll import CollChecks

__all__ = ["P2P", "COLL", "BYE", "ABORT", "PROBE", "MISMATCH", "WAITING", "MORE", "RECV_TICK",
           "FrameReader"]

#: PROBE: "I have waited on you in this collective" (header only); MISMATCH: a description of
#: the mismatched collectives that failed a group (``_coll``); WAITING: what the sender is
#: blocked in (``Backend.tell_waiting``: the watchdog's note, kept per sender in ``waits``)
P2P, COLL, BYE, ABORT, PROBE, MISMATCH, WAITING = 1, 2, 3, 4, 5, 6, 7
KINDS = frozenset({P2P, COLL, BYE, ABORT, PROBE, MISMATCH, WAITING})
#: control frames with a payload (one short frame each, read like a message)
_NOTES = frozenset({MISMATCH, WAITING})
#: longest MISMATCH description or WAITING note accepted
NOTE_CAP = 4096
#: header flag: more frames of the same message follow
MORE = 1
#: SO_RCVTIMEO of peer sockets: a direct reader blocks in recv() itself (no poll() per message)
#: and gets control back this often to check its deadline
RECV_TICK = 0.1
_WAITALL = getattr(socket, "MSG_WAITALL", 0)
#: unexpected payloads from this size on are read into uninitialised memory (``np.empty``)
_UNZEROED = 64 * 1024
_HDR = wire.HEADER.size
_unpack = wire.unpack_frame_from
_monotonic = time.monotonic


class FrameReader:
    """The receiving half of the mesh: parse, match and deliver frames. ``Transport`` holds one
    (``transport.frames``) and every thread that reads a peer's socket comes here.

    It is given, and shares with the transport: ``rank`` (in messages), ``cap`` (largest frame),
    ``lock`` guarding ``posted`` and ``unexpected`` (per (source, kind, channel, tag) queues of
    receives, and of (payload, signature)), the caps on messages no receive was posted for
    (``unposted_caps``, ``unposted_tag_caps``, see ``_past_cap``), the transport's
    ``abort_channel``, and ``checks`` (``_coll.CollChecks``: the signature checks and its
    ``mismatched`` channels). Every method here runs with ``peer.rlock`` held.
    """

    __slots__ = ("rank", "cap", "lock", "posted", "unexpected", "unposted_caps",
                 "unposted_tag_caps", "_abort_channel", "_mismatched", "_check_arrival",
                 "_sig_differs", "_on_probe", "_on_mismatch_note", "waits")

    def __init__(self, *, rank: int, cap: int, lock: Any,
                 posted: dict[tuple, collections.deque[_Req]],
                 unexpected: dict[tuple, collections.deque[tuple[Any, tuple]]],
                 unposted_caps: dict[int, int], unposted_tag_caps: dict[tuple[int, int], int],
                 abort_channel: Callable[..., None], checks: CollChecks) -> None:
        self.rank, self.cap, self.lock = rank, cap, lock
        self.posted, self.unexpected = posted, unexpected
        #: channel -> most bytes of a p2p message kept for a receive not yet posted
        #: (``cap_unposted``)
        self.unposted_caps = unposted_caps
        #: (channel, tag) -> the same for one tag, winning over the channel's (set with it)
        self.unposted_tag_caps = unposted_tag_caps
        self._abort_channel = abort_channel
        # the checks' bound methods and dict, held directly: no second hop per frame
        self._mismatched: dict[int, str] = checks.mismatched
        self._check_arrival = checks.check_arrival
        self._sig_differs = checks.sig_differs
        self._on_probe = checks.on_probe
        self._on_mismatch_note = checks.on_mismatch_note
        #: world rank -> (arrival, its newest WAITING note): one per sender, so a peer
        #: cannot grow it
        self.waits: dict[int, tuple[float, str]] = {}

    def read_frame(self, peer: _Peer, deadline: float | None = None) -> bool:
        """Read and dispatch one whole frame; the caller holds ``peer.rlock``.

        Returns False when nothing (more) arrived within ``RECV_TICK`` or, for a thread waiting
        on its own receive, by ``deadline``. A frame cut short stays in ``peer.fill`` and is
        finished by whichever thread reads next, so a peer that stalls in the middle of a
        message (stopped, swapped out) never holds a waiter past its deadline.
        """
        if peer.fill is not None:
            if not self._fill(peer, deadline):
                return False
            self._frame_done(peer)
            return True
        sock, src, view = peer.sock, peer.rank, peer.sview
        pos, end = peer.spos, peer.send
        if end - pos < _HDR:
            if end > pos:
                view[:end - pos] = view[pos:end]
            end -= pos
            pos = 0
            peer.spos, peer.send = 0, end
            while end < _HDR:
                try:
                    k = sock.recv_into(view[end:], _STAGE - end)
                except BlockingIOError:  # SO_RCVTIMEO expired; a partial header stays staged
                    if not end or (deadline is not None and _monotonic() >= deadline):
                        return False
                    continue
                if k == 0:
                    raise ConnectionError("connection closed by peer")
                end += k
                peer.send = end
        kind, flags, sig, channel, tag, n = _unpack(peer.stage, pos, KINDS, self.cap)
        pos += _HDR
        if kind > COLL:
            if n and kind not in _NOTES:
                raise ProtocolError(f"control frame of kind {kind} with a {n}-byte payload")
            if kind == BYE:
                peer.spos = pos
                peer.why, peer.crashed = FINALIZED, False
                return True
            if kind == ABORT:
                peer.spos = pos
                self._abort_channel(tag, channel, f"rank {src} abandoned a collective on this "
                                   "group after a timeout", (), notify=False)
                return True
            if kind == PROBE:
                peer.spos = pos
                self._on_probe(src, channel, sig)
                return True
            if n > NOTE_CAP or flags:  # MISMATCH, WAITING: one short frame, read like a message
                raise ProtocolError(f"mismatch note of {n} bytes (cap {NOTE_CAP}, one frame)")
        cur = peer.cur
        if cur is None:
            key = (src, kind, channel, tag)
            with self.lock:
                req = self._take_posted(key)
            if kind == COLL:
                if req is None:
                    self._check_arrival(src, channel, sig)
                elif req.sig != sig:  # another call's message: never into this buffer
                    req.finish(self._sig_differs(src, channel, req.sig, sig))
                    req = None
            elif req is not None and wire.p2p_refuses(req.sig, sig):
                # another dtype than the receive's: it fails, the message waits for another
                req.finish(self.refusal(req, sig, None))
                with self.lock:
                    req = self._take_fitting(key, sig)
            cur = peer.cur = [key, req, 0, [], sig]
        elif cur[1] is not None and cur[1].abandoned:
            self.redirect(peer)
        req, off, chunks = cur[1], cur[2], cur[3]
        if req is not None and req.error is None and off + n <= req.nbytes:
            dest = req.view[off:off + n] if off or n != req.nbytes else req.view
        elif chunks is None or req is None and self._past_cap(cur, n):
            dest = None  # drained as it comes: nothing is allocated for it
        else:
            # a large payload's memory is written by the socket read alone (not zeroed first)
            buf = bytearray(n) if n < _UNZEROED else np.empty(n, np.uint8)
            chunks.append(buf)
            dest = memoryview(buf)
        take = min(n, peer.send - pos)  # read-ahead bytes first
        if take and dest is not None:
            dest[:take] = view[pos:pos + take]
        # the header and the read-ahead are consumed only now, together with the state that
        # lets any thread resume the payload (an exception above leaves the frame unread)
        peer.fill = [dest, take, n, flags]
        peer.spos = pos + take
        if take < n and not self._fill(peer, deadline):
            return False
        self._frame_done(peer)
        return True

    def _past_cap(self, cur: list[Any], n: int) -> bool:
        """Whether an unexpected message grows past its cap (its tag's in
        ``unposted_tag_caps``, else its channel's in ``unposted_caps``): then it is dropped
        (``cur``'s chunks become None) and the rest of it drained. Checked before each frame's
        payload gets memory, so an oversized message never has more than its cap allocated."""
        caps, tag_caps = self.unposted_caps, self.unposted_tag_caps
        if not caps and not tag_caps:
            return False
        key = cur[0]
        if key[1] != P2P:
            return False
        cap = tag_caps.get((key[2], key[3])) if tag_caps else None
        if cap is None:
            cap = caps.get(key[2])
        if cap is None or cur[2] + n <= cap:
            return False
        wire.LOG.warning("rank %d dropped a message from rank %d (channel %d, tag %d): no "
                         "receive was posted for it and it passes its cap of %d bytes",
                         self.rank, key[0], key[2], key[3], cap)
        cur[3] = None
        return True

    def _fill(self, peer: _Peer, deadline: float | None) -> bool:
        """Read the rest of the payload in ``peer.fill`` straight into its destination (zero
        copy); False, keeping what arrived, if ``deadline`` passes first. Progress is recorded
        after every read, so an exception (Ctrl-C) in between loses no byte."""
        fill, cur, sock = peer.fill, peer.cur, peer.sock
        n = fill[2]
        while fill[1] < n:
            if cur is not None and cur[1] is not None and cur[1].abandoned:
                self.redirect(peer)  # its owner gave up on it: keep the message ourselves
            got = fill[1]
            try:
                if fill[0] is None:  # a dropped message: drained through a small buffer
                    k = sock.recv_into(peer.drain, min(n - got, len(peer.drain)))
                else:
                    # MSG_WAITALL: one wake-up per large piece, not one per segment
                    k = sock.recv_into(fill[0][got:], n - got, _WAITALL)
            except BlockingIOError:  # nothing for a RECV_TICK
                k = -1
            if k == 0:
                raise ConnectionError("connection closed by peer")
            if k > 0:
                fill[1] = got + k
            if fill[1] < n and deadline is not None and _monotonic() >= deadline:
                return False
        return True

    def redirect(self, peer: _Peer) -> None:
        """The receive the arriving message matched was abandoned (timeout): move what arrived,
        and the rest, into buffers of our own, so the message waits for a later receive and
        nothing more is written into the abandoned buffer. The caller holds ``peer.rlock``."""
        cur, fill = peer.cur, peer.fill
        req, off = cur[1], cur[2]
        chunks: list[Any] = [bytearray(req.view[:off])] if off else []
        if fill is not None:
            got, n = fill[1], fill[2]
            buf = bytearray(n)
            buf[:got] = fill[0][:got]
            chunks.append(buf)
            fill[0] = memoryview(buf)
        cur[1], cur[3] = None, chunks
        req.finish(PeerFailureError(f"{_text(req.desc)}: abandoned after a timeout"))

    def _frame_done(self, peer: _Peer) -> None:
        """The payload of the current frame is in place: complete its message if it was the last."""
        cur = peer.cur
        flags = peer.fill[3]
        req = cur[1]
        if req is not None and not flags & MORE:
            with self.lock:  # the last frame: hand the message over unless it was given up
                given_up = req.abandoned
                req.claimed = not given_up
            if given_up:
                self.redirect(peer)
        n = peer.fill[2]
        peer.fill = None
        key, req, off, chunks, _sig = cur
        cur[2] = off + n
        if flags & MORE:
            return
        peer.cur = None
        if req is not None:
            self._finish_recv(req, off + n, chunks)
            return
        if chunks is None:
            return  # dropped (``_past_cap``)
        if self.arrived(key, chunks[0] if len(chunks) == 1 else b"".join(chunks), cur[4]):
            peer.queued = key

    def _take_posted(self, key: tuple) -> _Req | None:
        """The oldest receive posted for ``key``, unposted; the caller holds ``self.lock``."""
        q = self.posted.get(key)
        if not q:
            return None
        req = q.popleft()
        if not q:
            del self.posted[key]
        return req

    def _take_fitting(self, key: tuple, sig: tuple) -> _Req | None:
        """``_take_posted`` for a p2p message with ``sig``: receives of another dtype before
        the first that fits fail (``refusal``); the caller holds ``self.lock``."""
        while True:
            req = self._take_posted(key)
            if req is None or not wire.p2p_refuses(req.sig, sig):
                return req
            req.finish(self.refusal(req, sig, None))

    def refusal(self, req: _Req, sig: tuple, nbytes: int | None) -> CollectiveMismatchError:
        """The error of a p2p receive into a buffer of another dtype than its message's."""
        src, _kind, _channel, tag = req.key
        dt, shape = wire.p2p_meta(sig, nbytes) if nbytes is not None else (None, None)
        sent = (f"{dt} {shape}" if dt is not None
                else str(SUPPORTED_DTYPES[sig[1] - 1]) if 0 < sig[1] <= len(SUPPORTED_DTYPES)
                else "of an unknown dtype")
        mine = SUPPORTED_DTYPES[req.sig[1] - 1]
        return CollectiveMismatchError(
            f"recv on rank {self.rank}: the message from rank {src} (tag {tag}) is {sent}, the "
            f"receive buffer {mine} ({req.nbytes} bytes): a send and its receive must have the "
            f"same dtype")

    def arrived(self, key: tuple, data: bytes | bytearray | np.ndarray,
                 sig: tuple = wire.NOSIG) -> bool:
        """A whole message: into the oldest receive posted for it, else the unexpected queue
        (then True)."""
        kind = key[1]
        if kind != P2P:
            if kind == MISMATCH:
                self._on_mismatch_note(key[0], key[2], bytes(data))
                return False
            if kind == WAITING:
                self.waits[key[0]] = (_monotonic(), bytes(data).decode("utf-8", "replace"))
                return False
            if key[2] in self._mismatched:
                return False  # a failed group's message: nobody will receive it
        with self.lock:
            req = self._take_posted(key) if kind != P2P else self._take_fitting(key, sig)
            if req is None:
                self.unexpected.setdefault(key, collections.deque()).append((data, sig))
            else:
                req.claimed = True  # too late to give it up (see ``Transport._unpost``)
        if req is None:
            return True
        self.deliver(req, data, sig)
        return False

    def _finish_recv(self, req: _Req, got: int, chunks: list[bytes]) -> None:
        if got != req.nbytes or chunks:
            req.finish(_size_error(req, got))
        else:
            req.finish()

    def deliver(self, req: _Req, data: bytes, sig: tuple) -> None:
        """A queued or loopback message into ``req``, if it belongs to the same call."""
        if req.sig != sig and req.key[1] == COLL:
            src, _kind, channel, _tag = req.key
            req.finish(self._sig_differs(src, channel, req.sig, sig))
        elif len(data) != req.nbytes:
            req.finish(_size_error(req, len(data)))
        else:
            req.view[:] = data
            req.finish()


def _size_error(req: _Req, got: int) -> Exception:
    """A message of another size than the receive buffer: the user's p2p mistake, or (should
    the signatures agree, which they do for equal counts) a collective the ranks disagree on."""
    src, kind, _channel, tag = req.key
    if kind == COLL:
        return CollectiveMismatchError(
            f"a collective message from rank {src} has {got} bytes where this rank expects "
            f"{req.nbytes}: the ranks called the collective with different sizes")
    return ValueError(f"recv from rank {src} with tag {tag}: the message has {got} bytes, the "
                      f"receive buffer {req.nbytes} (sizes must match exactly)")
