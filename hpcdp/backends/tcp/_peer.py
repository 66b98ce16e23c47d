"""Per-peer state and request objects of the TCP mesh (``_transport`` drives them).

A ``_Req`` completes by releasing a lock, so waiters sleep instead of polling; when its waiting
thread may read the peer's socket itself, ``reader`` names the transport and peer to read from.
``_Peer`` holds one connection's send queue, the read-ahead stage and the parser state that
whoever holds ``rlock`` advances.
"""
from __future__ import annotations

import collections
import select
import socket
import threading
from typing import TYPE_CHECKING, Any

from ._wire import NOSIG
from ..base import Request

if TYPE_CHECKING:
    from ._transport import Transport

_STAGE = 64 * 1024
_POLLIN = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR


class _Req(Request):
    """A send or receive; completion is a released lock, so waiters sleep instead of polling."""

    __slots__ = ("_lock", "done", "error", "view", "nbytes", "desc", "key", "sig", "reader",
                 "owner", "abandoned", "claimed")

    def __init__(self, view: memoryview | None, desc: str, key: Any = None,
                 sig: tuple = NOSIG) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.done = False
        self.error: BaseException | None = None
        self.view = view
        self.nbytes = 0 if view is None else view.nbytes
        self.desc = desc
        self.key = key
        #: the collective call a receive belongs to (``_coll``); NOSIG outside collectives
        self.sig = sig
        #: (transport, peer) when the waiting thread may read the peer's socket itself
        self.reader: tuple[Transport, _Peer] | None = None
        #: the transport a posted receive waits in (None for sends)
        self.owner: Transport | None = None
        #: given up on after a timeout: its message, if one arrives, is kept for a later receive
        self.abandoned = False
        #: its message is complete and being handed over: too late to give it up (both flags
        #: change under the transport's lock, so exactly one of them wins)
        self.claimed = False

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
        if not self.done and self.reader is not None:
            t, peer = self.reader
            t._poll_once(peer, self._is_done)
        return self._check()

    def _is_done(self) -> bool:
        return self.done

    def wait(self, timeout: float | None) -> bool:
        if not self.done:
            if self.reader is not None:
                t, peer = self.reader
                t._direct_wait(self, peer, timeout)
            elif self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
                self._lock.release()
        return self._check()

    def pending(self) -> str:
        return _text(self.desc)

    def abandon(self) -> bool:
        """Given up on after a timeout: a receive still waiting for its message is unposted, so
        a late message is not written into a buffer its owner has taken back. True when the
        message had completed after all (the caller then reports success, not a timeout)."""
        if self.owner is not None:
            return self.owner._unpost(self)
        return self.done and self.error is None


class _Sent(Request):
    """A send that already went out on the caller's thread: nothing to wait for."""

    __slots__ = ("desc",)
    done = True
    error = None

    def __init__(self, desc: Any) -> None:
        self.desc = desc

    def test(self) -> bool:
        return True

    def wait(self, timeout: float | None) -> bool:
        return True

    def pending(self) -> str:
        return _text(self.desc)


def _text(desc: Any) -> str:
    """Descriptions are built lazily: a ``(format, *args)`` tuple is %-formatted when shown."""
    return desc[0] % desc[1:] if type(desc) is tuple else desc


class _Peer:
    def __init__(self, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.sock = sock
        self.send_lock = threading.Lock()
        self.qlock = threading.Lock()
        self.qcv = threading.Condition(self.qlock)
        self.sendq: collections.deque[tuple[bytes, memoryview, _Req]] = collections.deque()
        self.sender: threading.Thread | None = None
        self.eof = threading.Event()
        # receiving: whoever holds rlock reads frames; the parser state below is guarded by it
        self.rlock = threading.Lock()
        # bytes read ahead of the parser: a small frame arrives in one recv() with its header
        self.stage = bytearray(_STAGE)
        self.sview = memoryview(self.stage)
        self.drain = memoryview(bytearray(_STAGE))  # where a dropped message's bytes go
        self.spos = self.send = 0
        self.cur: list[Any] | None = None  # message in progress: [key, req or None, offset, chunks, sig]
        #: key of the last message this stream put in the unexpected queue (a probe that reads
        #: stops at the one it looks for, see ``Transport.probe``)
        self.queued: tuple | None = None
        #: frame payload in progress: [destination view, bytes in, frame bytes, frame flags]
        self.fill: list[Any] | None = None
        self.stopped = False  # the stream ended (EOF, error or malformed frame): nothing more to read
        self.why, self.crashed = "closed its connection (process exited or crashed)", True
        self.direct_poll = select.poll()  # used only under rlock (poll objects are not shareable)
        self.direct_poll.register(sock, _POLLIN)
        self.bg_poll = select.poll()  # used only by the background receiver
        self.bg_poll.register(sock, _POLLIN)
        self.linger_until = 0.0
        self.bgcv = threading.Condition(threading.Lock())
        self.parked = False
